"""The OpenAI-shaped HTTP surface: request schema, image-string decoding, response bodies, and the
error mapping (every client mistake becomes a 4xx OpenAI error object, never a 500).

`api` is the FastAPI app the ingress deployment serves (`serve.ingress(api)`); its exception
handlers live here, its routes on `deployments.ingress.VisionIngress`.
"""

# No `from __future__ import annotations`: FastAPI reads the request model from route signatures.
import base64
import binascii
import io
import json
import logging
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from encoder.errors import (
    ConfigError,
    EncoderError,
    ImageDecodeError,
    ImageTooLargeError,
    InvalidArgumentError,
    InvalidImageError,
)
from encoder.preprocess import PreprocessConfig, load_image, resize_image

logger = logging.getLogger("ray.serve")


# ------------------------------------------------------------------------------------------ errors


class RequestError(InvalidArgumentError):
    """A client mistake the ingress detects itself (bad base64, data URL, media type, too many images)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request", param: str | None = "input"):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def root_cause(exc: BaseException) -> BaseException:
    """The user exception inside a Ray task error raised by a replica (Ray keeps it as `.cause`)."""
    seen = 0
    while isinstance(getattr(exc, "cause", None), BaseException) and seen < 8:
        exc, seen = exc.cause, seen + 1
    return exc


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    """(HTTP status, OpenAI error type, code, param) for an exception."""
    exc = root_cause(exc)
    if isinstance(exc, RequestError):
        return exc.status, "invalid_request_error", exc.code, exc.param
    if isinstance(exc, ImageTooLargeError):
        return 413, "invalid_request_error", "image_too_large", "input"
    if isinstance(exc, ImageDecodeError | InvalidImageError):
        return 400, "invalid_request_error", "invalid_image", "input"
    if isinstance(exc, InvalidArgumentError):
        return 400, "invalid_request_error", "invalid_argument", None
    if isinstance(exc, EncoderError) and not isinstance(exc, ConfigError):
        return 400, "invalid_request_error", "invalid_request", None
    return 500, "server_error", "internal_error", None


def error_body(message: str, type_: str, code: str | None, param: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: BaseException) -> JSONResponse:
    status, type_, code, param = classify(exc)
    message = str(root_cause(exc)) if status < 500 else f"internal error: {type(root_cause(exc)).__name__}"
    if status >= 500:
        logger.exception("request failed", exc_info=exc)
    return JSONResponse(error_body(message, type_, code, param), status_code=status)


def with_index(exc: EncoderError, where: str) -> EncoderError:
    """The same error type with the input position prefixed to its message."""
    if isinstance(exc, RequestError):
        return RequestError(f"{where}: {exc}", exc.status, exc.code, exc.param)
    try:
        new = type(exc)(f"{where}: {exc}")
    except Exception:  # noqa: BLE001 - an exception type with another constructor: keep the original
        return exc
    new.__cause__ = exc
    return new


# ------------------------------------------------------------------------------------------ inputs


def decode_base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:  # tolerate line breaks (MIME-style base64), nothing else
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"invalid base64 image data: {e}", code="invalid_base64") from None


def decode_image_string(text: str) -> bytes:
    """A data URL (`data:image/png;base64,...`) or bare base64 -> the encoded image bytes."""
    if text.startswith("data:"):
        header, comma, payload = text.partition(",")
        if not comma:
            raise RequestError("malformed data URL: no ',' before the data", code="invalid_data_url")
        media, *params = (p.strip().lower() for p in header[5:].split(";"))
        if "base64" not in params:
            message = "data URLs must be base64-encoded ('data:image/png;base64,...')"
            raise RequestError(message, code="invalid_data_url")
        if media and not media.startswith("image/"):
            raise RequestError(f"unsupported media type {media!r}; send an image", 415, "unsupported_media_type")
        return decode_base64(payload)
    if text.startswith(("http://", "https://")):
        raise RequestError("image URLs are not fetched; send a data URL or base64 image", code="invalid_image_url")
    return decode_base64(text)


def identify_format(data: bytes) -> str | None:
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.format
    except Exception:  # noqa: BLE001 - unidentifiable bytes
        return None


def prepare_image(x: Any, pp: PreprocessConfig) -> np.ndarray:
    """One input (str, bytes, PIL image, uint8 array) -> uint8 [H, W, 3] at the model's resize size."""
    if isinstance(x, str):
        x = decode_image_string(x)
    try:
        img = load_image(x, pp)
    except ImageDecodeError:
        fmt = identify_format(bytes(x)) if isinstance(x, bytes | bytearray | memoryview) else None
        if fmt is not None and fmt not in pp.allowed_formats and fmt != "MPO":
            allowed = ", ".join(sorted(pp.allowed_formats))
            raise RequestError(
                f"image format {fmt} is not supported (supported: {allowed})", 415, "unsupported_image_format"
            ) from None
        raise
    return resize_image(img, pp)


# ------------------------------------------------------------------------------------------ HTTP schema


class EmbeddingRequest(BaseModel):
    """OpenAI `POST /v1/embeddings` body, with images as data URLs or bare base64 in `input`."""

    model_config = ConfigDict(extra="ignore")

    input: str | Annotated[list[str], Field(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "none"] = Field(
        "mean", description="Extension: 'mean' (one vector per image) or 'none' (one vector per output token)."
    )
    dimensions: int | None = Field(None, description="Accepted only if equal to the model's output width.")
    user: str | None = None


def embedding_item(index: int, vec: np.ndarray, encoding_format: str) -> dict:
    """One `data[]` entry. pooling=none: `embedding` is [tokens][out_dim] (float) or the row-major
    flattened matrix (base64), and `shape` gives [tokens, out_dim]."""
    item: dict[str, Any] = {"object": "embedding", "index": index}
    if encoding_format == "base64":
        item["embedding"] = base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode("ascii")
    else:
        item["embedding"] = vec.tolist()
    if vec.ndim == 2:
        item["shape"] = list(vec.shape)
    return item


def embeddings_body(vectors: list[np.ndarray], encoding_format: str, model: str, patches: int) -> bytes:
    body = {
        "object": "list",
        "data": [embedding_item(i, v, encoding_format) for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": patches, "total_tokens": patches},
    }
    return json.dumps(body, separators=(",", ":")).encode()


api = FastAPI(title="Vision encoding service", version="0.1.0")


@api.exception_handler(EncoderError)
async def _encoder_error(request: Request, exc: EncoderError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return JSONResponse(error_body("the request body is not valid JSON", "invalid_request_error",
                                       "invalid_json", None), status_code=400)  # fmt: skip
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}" for e in errors)
    return JSONResponse(
        error_body(message, "invalid_request_error", "invalid_schema", loc[0] if loc else None), status_code=422
    )


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), type_, code, None), status_code=exc.status_code)


@api.exception_handler(Exception)
async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)
