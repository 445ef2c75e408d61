"""The OpenAI-shaped HTTP surface: request schema, image-string decoding, response bodies, and the
error mapping (every client mistake becomes a 4xx OpenAI error object, never a 500).

`api` is the FastAPI app the ingress deployment serves (`serve.ingress(api)`); its exception
handlers live here, its routes on `deployments.ingress.VisionIngress`.
"""

# No `from __future__ import annotations`: FastAPI reads the request model from route signatures.
import binascii
import logging
import math
import re
from typing import Annotated, Any, Literal

import numpy as np
import orjson
import pybase64
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from encoder.errors import (
    ConfigError,
    EncoderError,
    ImageDecodeError,
    ImageTooLargeError,
    InvalidArgumentError,
    InvalidImageError,
)
from encoder.preprocess import PreprocessConfig

from .llm_outputs import EMBEDDING_DTYPES, to_wire

logger = logging.getLogger("ray.serve")


# ------------------------------------------------------------------------------------------ errors


class RequestError(InvalidArgumentError):
    """A client mistake the ingress detects itself (bad base64, data URL, media type, limits, API key)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request", param: str | None = "input"):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


# Errors of a call to an encoder replica that say the replica (or its node) went away, not that the request
# was bad: the ingress retries these (encoding is idempotent); when retries run out they answer 503.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    RayActorError,  # ActorDiedError, ActorUnavailableError
    WorkerCrashedError,
    NodeDiedError,
    ObjectLostError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
)


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
        return exc.status, _error_type(exc.status), exc.code, exc.param
    if isinstance(exc, ImageTooLargeError):
        return 413, "invalid_request_error", "image_too_large", "input"
    if isinstance(exc, ImageDecodeError | InvalidImageError):
        return 400, "invalid_request_error", "invalid_image", "input"
    if isinstance(exc, InvalidArgumentError):
        return 400, "invalid_request_error", "invalid_argument", None
    if isinstance(exc, EncoderError) and not isinstance(exc, ConfigError):
        return 400, "invalid_request_error", "invalid_request", None
    if isinstance(exc, BackPressureError):
        status = exc.status_code if exc.status_code in (429, 503) else 503
        return status, _error_type(status), "overloaded", None
    if isinstance(exc, UNAVAILABLE_ERRORS):
        return 503, "server_error", "encoder_unavailable", None
    if isinstance(exc, TimeoutError):
        return 504, "server_error", "timeout", None
    return 500, "server_error", "internal_error", None


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, type_: str, code: str | None, param: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_MESSAGES = {
    "overloaded": "the service is over capacity; retry after the time in the Retry-After header",
    "encoder_unavailable": "no encoder replica could take the request; retry after the time in the Retry-After header",
    "timeout": "the request took longer than the service's time limit",
}


def error_response(exc: BaseException, retry_after_s: float | None = 1.0) -> JSONResponse:
    """The OpenAI error object for `exc`, with `Retry-After` on 429 / 503 and `WWW-Authenticate` on 401."""
    status, type_, code, param = classify(exc)
    cause = root_cause(exc)
    if status < 500 and status != 429:
        message = str(cause)
    elif code in _MESSAGES:
        message = f"{_MESSAGES[code]} ({type(cause).__name__})" if code != "timeout" else _MESSAGES[code]
    else:
        message = f"internal error: {type(cause).__name__}"
    if status == 500:
        logger.exception("request failed", exc_info=exc)
    headers = {}
    if status in (429, 503) and retry_after_s is not None:
        headers["Retry-After"] = str(max(0, math.ceil(retry_after_s)))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


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
        return pybase64.b64decode(text, validate=True)  # SIMD: ~60x the standard library's speed
    except (binascii.Error, ValueError):
        pass
    try:  # tolerate line breaks (MIME-style base64), nothing else
        return pybase64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"invalid base64 image data: {e}", code="invalid_base64") from None


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,15}://")


def is_url(text: str) -> bool:
    """`scheme://...`: never base64 (':' and '/' after letters cannot start a base64 image)."""
    return bool(_URL.match(text))


def image_too_large(size: int, limit: int, what: str = "image") -> RequestError:
    return RequestError(f"{what} is {size} bytes, over the limit of {limit} bytes", 413, "image_too_large")


def parse_image_string(text: str, max_bytes: int | None = None) -> tuple[bytes, str | None]:
    """A data URL (`data:image/png;base64,...`) or bare base64 -> (encoded image bytes, declared media type).

    `max_bytes`: the encoded-image limit, checked from the base64 length before decoding and exactly after.
    URLs are not handled here (RequestError 400); see `deployments.security.UrlFetcher`.
    """
    media = None
    if text[:5].lower() == "data:":
        header, comma, payload = text.partition(",")
        if not comma:
            raise RequestError("malformed data URL: no ',' before the data", code="invalid_data_url")
        if len(header) > 256:
            raise RequestError("malformed data URL: header longer than 256 characters", code="invalid_data_url")
        media, *params = (p.strip().lower() for p in header[5:].split(";"))
        if "base64" not in params:
            message = "data URLs must be base64-encoded ('data:image/png;base64,...')"
            raise RequestError(message, code="invalid_data_url")
        if media and not media.startswith("image/"):
            raise RequestError(f"unsupported media type {media!r}; send an image", 415, "unsupported_media_type")
        text = payload
    elif is_url(text):
        scheme = text.split(":", 1)[0].lower()
        raise RequestError(
            f"{scheme} image URLs are not fetched by this service; send a data URL or base64 image",
            code="invalid_image_url",
        )
    if max_bytes is not None and (len(text) * 3) // 4 > max_bytes + max_bytes // 16 + 16:  # surely over
        raise image_too_large((len(text) * 3) // 4, max_bytes, "image (estimated from its base64 length)")
    data = decode_base64(text)
    if max_bytes is not None and len(data) > max_bytes:
        raise image_too_large(len(data), max_bytes)
    return data, media or None


def decode_image_string(text: str) -> bytes:
    """A data URL (`data:image/png;base64,...`) or bare base64 -> the encoded image bytes."""
    return parse_image_string(text)[0]


def prepare_image(x: Any, pp: PreprocessConfig) -> np.ndarray:
    """One input (str, bytes, PIL image, uint8 array) -> uint8 [H, W, 3] at the model's resize size.

    The header checks of `deployments.limits.open_input` (format allowlist: 415; pixel limit: 413), then
    the decode and resize."""
    from .limits import finish_input, open_input

    return finish_input(open_input(x, pp), pp)


# ------------------------------------------------------------------------------------------ HTTP schema


class EmbeddingRequest(BaseModel):
    """OpenAI `POST /v1/embeddings` body, with images as data URLs or bare base64 in `input`."""

    model_config = ConfigDict(extra="ignore")

    input: str | Annotated[list[str], Field(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["model", "mean", "none", "model-l2", "mean-l2"] | None = Field(
        None,
        description="Extension: 'model' (the model's own image embedding: CLIP / SigLIP), 'mean' (mean of the "
        "output tokens), 'none' (one vector per output token), '-l2' for L2-normalised vectors; default: the "
        "model's ('model' for CLIP / SigLIP, 'mean' for Qwen).",
    )
    dimensions: int | None = Field(None, description="Accepted only if equal to the model's output width.")
    embedding_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="Extension, with encoding_format 'base64' only: the element type of the little-endian bytes, "
        "'float32', 'float16' or 'bfloat16' (the top 16 bits of float32, rounded to nearest even).",
    )
    user: str | None = None


def schema_error(errors: list[dict]) -> RequestError:
    """422 naming every schema violation (`input.str: Input should be a valid string; ...`)."""

    def where(e: dict) -> str:
        return ".".join(str(x) for x in e.get("loc", ()) if x != "body")

    message = "; ".join(f"{where(e) or 'body'}: {e.get('msg')}" for e in errors) or "invalid request body"
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    return RequestError(message, 422, "invalid_schema", loc[0] if loc else None)


def embedding_dtype_error(message: str) -> RequestError:
    return RequestError(message, 400, "invalid_embedding_dtype", "embedding_dtype")


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """The request body -> EmbeddingRequest; RequestError 400 (not JSON; a bad `embedding_dtype`) or 422 (schema)."""
    try:
        parsed = EmbeddingRequest.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        if any(x.get("type") == "json_invalid" for x in errors):
            detail = errors[0].get("msg", "").removeprefix("Invalid JSON: ")
            raise RequestError(f"the request body is not valid JSON: {detail}", 400, "invalid_json", None) from None
        if all(tuple(x.get("loc", ())) == ("embedding_dtype",) for x in errors):
            raise embedding_dtype_error(
                f"embedding_dtype must be one of {', '.join(EMBEDDING_DTYPES)} (a string)"
            ) from None
        raise schema_error(errors) from None
    if parsed.embedding_dtype != "float32" and parsed.encoding_format != "base64":
        raise embedding_dtype_error(
            f"embedding_dtype={parsed.embedding_dtype!r} needs encoding_format='base64' (JSON floats are float32)"
        )
    return parsed


def _b64(x: np.ndarray, dtype: str) -> bytes:
    """Base64 of `x`'s little-endian bytes in the wire `dtype` (no copy when `x` already is one)."""
    x = to_wire(x, dtype)
    return pybase64.b64encode(x if x.dtype.byteorder != ">" else x.astype(x.dtype.newbyteorder("<")))


def _meta(index: int, out) -> tuple[dict, np.ndarray, list[np.ndarray]]:
    """(the item's small fields, its embedding, its DeepStack arrays) for a vector, a token matrix or an
    LLM output tuple (`deployments.llm_outputs.WireLLM`: tokens, DeepStack layers, patch grid)."""
    item: dict[str, Any] = {"object": "embedding", "index": index}
    if isinstance(out, tuple):
        vec, deepstack, grid = out
        item["shape"], item["grid_thw"] = list(vec.shape), list(grid)
        return item, vec, deepstack
    if out.ndim == 2:
        item["shape"] = list(out.shape)
    return item, out, []


def embeddings_body(outputs: list, encoding_format: str, model: str, patches: int, dtype: str = "float32") -> bytes:
    """The response body. `outputs`: per image a vector, a token matrix, or a `WireLLM` tuple (pooling=none:
    the item also carries `grid_thw` and, for DeepStack models, `deepstack`: one embedding per layer in the
    same encoding). `dtype`: the base64 element type (`EmbeddingRequest.embedding_dtype`)."""
    usage = {"prompt_tokens": patches, "total_tokens": patches}
    if encoding_format != "base64":
        data = []
        for i, out in enumerate(outputs):
            item, vec, deepstack = _meta(i, out)
            item["embedding"] = np.ascontiguousarray(vec, dtype=np.float32)  # orjson writes it natively
            if deepstack:
                item["deepstack"] = [np.ascontiguousarray(d, dtype=np.float32) for d in deepstack]
            data.append(item)
        body = {"object": "list", "data": data, "model": model, "usage": usage}
        # orjson formats float32 arrays in C, shortest round-trip text: 3,584 floats take ~0.1 ms where
        # json.dumps(vec.tolist()) takes ~1.6 ms (and writes twice the digits of float64 reprs).
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    # base64: the JSON is assembled around the base64 bytes (never JSON-escaped: A-Z a-z 0-9 + / =), so a
    # per-token answer is one base64 pass and one copy into the body, with no str in between.
    pieces = [b'{"object":"list","data":[']
    for i, out in enumerate(outputs):
        item, vec, deepstack = _meta(i, out)
        pieces += [b"," if i else b"", orjson.dumps(item)[:-1], b',"embedding":"', _b64(vec, dtype), b'"']
        if deepstack:
            pieces.append(b',"deepstack":["')
            for k, d in enumerate(deepstack):
                pieces += [b'","' if k else b"", _b64(d, dtype)]
            pieces.append(b'"]')
        pieces.append(b"}")
    pieces += [b'],"model":', orjson.dumps(model), b',"usage":', orjson.dumps(usage), b"}"]
    return b"".join(pieces)


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
    return error_response(schema_error(list(errors)))


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(
        error_body(f"{exc.detail} ({request.method} {request.url.path})", _error_type(exc.status_code), code, None),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


@api.exception_handler(Exception)
async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)
