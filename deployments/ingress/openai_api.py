"""The OpenAI-shaped HTTP surface: request schema, response bodies, and error answers (every client mistake
becomes a 4xx OpenAI error object, never a 500; which status and type is `deployments.errors`' table).

`api` is the FastAPI app the ingress deployment serves (`serve.ingress(api)`); its exception
handlers live here, its routes on `deployments.ingress.deployment.VisionIngress`.
"""

# No `from __future__ import annotations`: FastAPI reads the request model from route signatures.
import logging
import math
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
import orjson
import pybase64
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.errors import (
    ECHO_LIMIT,
    ErrorCode,
    RequestError,
    capped,
    classify,
    openai_type,
    root_cause,
    shown,
)
from deployments.ingress.cache import check_cache_uuid
from deployments.llm_outputs import EMBEDDING_DTYPES, to_wire, video_facts
from deployments.vllm_handoff import LAYOUTS
from encoder.errors import EncoderError
from encoder.poolings import POOLINGS

logger = logging.getLogger("ray.serve")


# ------------------------------------------------------------------------------------------ errors


def error_body(message: str, type_: str, code: str | None, param: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_OVER_CAPACITY = "the service is over capacity; retry after the time in the Retry-After header"
# what a server-side answer says (its cause's type is appended, never its text: it may hold internals)
_MESSAGES = {
    ErrorCode.RATE_LIMITED: _OVER_CAPACITY,
    ErrorCode.OVERLOADED: _OVER_CAPACITY,
    ErrorCode.ENCODER_UNAVAILABLE: "no encoder replica could take the request; retry after the time in the "
    "Retry-After header",
    ErrorCode.TIMEOUT: "the request took longer than the service's time limit",
    ErrorCode.SHUTTING_DOWN: "the service is shutting down; retry after the time in the Retry-After header",
}
# answers whose message is the whole story (no cause type appended)
_PLAIN = (ErrorCode.TIMEOUT, ErrorCode.SHUTTING_DOWN)


def error_response(exc: BaseException, retry_after_s: float | None = 1.0) -> JSONResponse:
    """The OpenAI error object for `exc`, with `Retry-After` on 429 / 503 and `WWW-Authenticate` on 401."""
    error, param = classify(exc)
    cause = root_cause(exc)
    if error.status < 500 and error is not ErrorCode.RATE_LIMITED:
        message = str(cause)
    elif error in _MESSAGES:
        message = _MESSAGES[error] if error in _PLAIN else f"{_MESSAGES[error]} ({type(cause).__name__})"
    else:
        message = f"internal error: {type(cause).__name__}"
    if error is ErrorCode.INTERNAL_ERROR:
        logger.exception("request failed", exc_info=exc)
    headers = {}
    if error.retry_after and retry_after_s is not None:
        headers["Retry-After"] = str(max(0, math.ceil(retry_after_s)))
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(
        error_body(message, error.type, error.code, capped(param)), status_code=error.status, headers=headers
    )


# ------------------------------------------------------------------------------------------ HTTP schema


class TextInput(BaseModel):
    """An `input` item that is a text: `{"text": "a red bicycle"}`."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(
        description="Non-empty. Tokenized as the model's tokenizer does: a text longer than the text tower's length "
        "(CLIP 77 tokens, SigLIP 64) is cut to it."
    )


class ImageInput(BaseModel):
    """An `input` item that is an image: `{"image": "data:image/png;base64,..."}` (or bare base64)."""

    model_config = ConfigDict(extra="forbid")

    image: str
    uuid: str | None = Field(
        None,
        description="Extension: the client's own key for this image in the service's encoder cache (1 to 256 "
        "characters), used instead of hashing its bytes: the same uuid must always mean the same image. Scoped by the "
        "API key the request presents: another key's uuid never reads this one's entries.",
    )


class VideoInput(BaseModel):
    """An `input` item that is a video (Qwen towers): `{"video": "data:video/mp4;base64,..."}` (or bare base64)."""

    model_config = ConfigDict(extra="forbid")

    video: str = Field(
        description="MP4 / MOV, WebM / Matroska or AVI (H.264, HEVC, VP8, VP9, AV1, MPEG-4) as a data URL or "
        "base64; sampled and resized as the checkpoint's video processor, within the video limits."
    )


INPUT_TYPES = ("image", "text", "video")


class EmbeddingRequest(BaseModel):
    """OpenAI `POST /v1/embeddings` body, with images as data URLs or bare base64 in `input`, and texts. An unknown
    field is refused, as OpenAI's API refuses one: ignored, a misspelt extension (`poolling`, `embeding_dtype`)
    would give another answer than the one asked for, silently."""

    model_config = ConfigDict(extra="forbid")

    input: str | Annotated[list[str | TextInput | ImageInput | VideoInput], Field(min_length=1)] = Field(
        description="One item or a non-empty list. A string is what `input_type` says (an image by default: a data "
        'URL or base64); an object is {"text": ...}, {"image": ...} or {"video": ...} (Qwen towers). Items may be '
        "mixed; the answer holds one embedding per item, in order."
    )
    input_type: Literal[INPUT_TYPES] = Field(
        "image",
        description="Extension: what plain strings in `input` are, 'image' (the default), 'text' (with the openai "
        "client: extra_body={'input_type': 'text'}) or 'video'. Text needs a model with a text tower (CLIP, SigLIP2 "
        "with their tokenizer files): else 400 text_not_supported; video a Qwen tower: else 400 video_not_supported.",
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal[POOLINGS] | None = Field(
        None,
        description="Extension: 'model' (the model's own image embedding: CLIP / SigLIP), 'mean' (mean of the "
        "output tokens), 'none' (one vector per output token), '-l2' for L2-normalised vectors; default: the "
        "model's ('model' for CLIP / SigLIP, 'mean' for Qwen). The schema takes every family's names (another "
        "name is 422 invalid_schema); one the served model does not offer ('model' for Qwen) is 400 "
        "invalid_pooling, naming the model's poolings. Text items take 'model' (the default: the model's text "
        "embedding) and 'model-l2'; another pooling in a request with text is 400 invalid_pooling.",
    )
    dimensions: int | None = Field(None, description="Accepted only if equal to the model's output width.")
    embedding_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="Extension, with encoding_format 'base64' only: the element type of the little-endian bytes, "
        "'float32', 'float16' or 'bfloat16' (the top 16 bits of float32, rounded to nearest even).",
    )
    embedding_layout: Literal[LAYOUTS] = Field(
        "parts",
        description="Extension, for the per-token LLM outputs of Qwen towers: 'parts' (the default: `embedding` holds "
        "the tokens, `deepstack` each DeepStack layer) or 'vllm' (`embedding` is the one [tokens, out_dim x (1 + "
        "layers)] tensor vLLM's Qwen models produce and take as image_embeds: the tokens, then each DeepStack "
        "layer, on the last axis; no `deepstack` key). 'vllm' implies pooling 'none'; another pooling, text items "
        "or a non-Qwen model is 400 invalid_layout.",
    )
    ec_cache_uuids: Annotated[list[str], Field(min_length=1)] | None = Field(
        None,
        description="Extension: one uuid per image; each image's vLLM-layout tensor is written for vLLM's disk "
        "encoder-cache connector as <ec_cache_dir>/<uuid>/encoder_cache.safetensors (key ec_cache) on the "
        "server, and the answer's items are {object: 'ec_cache', index, uuid, shape, dtype, grid_thw} without "
        "the tensor. Send vLLM the same uuid with the image. A uuid is 1 to 255 of A-Z a-z 0-9 . _ - : not "
        "starting with '.', distinct (else 400 invalid_uuid); a service without ec_cache_dir answers 400 "
        "ec_cache_not_configured. The file's dtype: embedding_dtype when given, else the served tower's own.",
    )
    cache: bool = Field(
        True,
        strict=True,
        description="Extension: false answers without the service's encoder cache (cache_mib): nothing is looked up "
        "or stored. Without a cache it changes nothing.",
    )
    user: str | None = None


FIELDS = tuple(EmbeddingRequest.model_fields)


class _Parsed(EmbeddingRequest):
    """What a body is parsed into: unknown fields are kept aside (`__pydantic_extra__`, one dict insert each)
    instead of becoming one validation error each, so a body of 200,000 unknown fields costs a parse, not an
    error list; `parse_embedding_request` refuses them afterwards, naming the first few. A list `input` stops
    at its first bad item (`fail_fast`): a million non-strings make one error, not a million (4 s of error
    dicts for a 2 MB body). Object items are read as dicts here and checked by `input_items`, which names
    the item (`input[3]: ...`) and answers a text that is not a non-empty string with 400 invalid_text."""

    model_config = ConfigDict(extra="allow")

    input: str | Annotated[list[str | dict], Field(min_length=1, fail_fast=True)]


class Items(NamedTuple):
    """A request's `input` split by kind: the images and the texts, each in order, and the kind of every item
    (`kinds[i]`, "image", "text" or "video": item i is the next one of its kind). `input_items` also sets
    `uuids`: per image its cache `uuid` or None (None: no image has one; videos have none: they bypass the cache)."""

    images: list[str]
    texts: list[str]
    kinds: list[str]
    videos: tuple | list = ()  # data URLs or base64 videos, in order

    def __len__(self) -> int:
        return len(self.kinds)

    def positions(self, kind: str) -> list[int]:
        """Where the items of `kind` are in `input`."""
        return [i for i, k in enumerate(self.kinds) if k == kind]


class _Items(Items):
    """`Items` with the images' cache uuids (an attribute: the tuple stays the three lists)."""

    uuids: list[str | None] | None = None


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def input_items(value: str | list, input_type: str = "image") -> Items:
    """`input` (as parsed) -> `Items`. A plain string is an item of `input_type`; an object has exactly one key,
    "text" or "image". RequestError: 422 invalid_schema for another object or a non-string image, 400
    invalid_text for a text that is not a non-empty string; both name the item (`input[2]`)."""
    values = [value] if isinstance(value, str) else value
    images, texts, kinds, videos, uuids = [], [], [], [], []
    for i, item in enumerate(values):
        where = "input" if isinstance(value, str) else f"input[{i}]"
        uuid = None
        if isinstance(item, str):
            kind, payload = input_type, item
        else:
            if "uuid" in item and "image" in item and len(item) == 2:  # {"image": ..., "uuid": ...}
                item = dict(item)
                uuid = check_cache_uuid(item.pop("uuid"), f"{where}.uuid")
            if len(item) != 1 or next(iter(item)) not in INPUT_TYPES:
                keys = ", ".join(shown(k, 30) for k in list(item)[:5]) or "none"
                raise RequestError(
                    f'{where} must be a string or an object with one key, "text", "image" or "video" '
                    f"(its keys: {keys})",
                    ErrorCode.INVALID_SCHEMA, where,
                )  # fmt: skip
            ((kind, payload),) = item.items()
            if kind in ("image", "video") and not isinstance(payload, str):
                raise RequestError(
                    f"{where}.{kind} must be a string (a data URL or base64 {kind}), not {_json_type(payload)}",
                    ErrorCode.INVALID_SCHEMA, where,
                )  # fmt: skip
        if kind == "text":
            if not isinstance(payload, str):
                raise RequestError(f"{where}: a text must be a string, not {_json_type(payload)}",
                                   ErrorCode.INVALID_TEXT, where)  # fmt: skip
            if not payload:
                raise RequestError(f"{where}: the text is an empty string", ErrorCode.INVALID_TEXT, where)
            texts.append(payload)
        elif kind == "video":
            videos.append(payload)
        else:
            images.append(payload)
            uuids.append(uuid)
        kinds.append(kind)
    items = _Items(images, texts, kinds, videos)
    items.uuids = uuids if any(u is not None for u in uuids) else None
    return items


def unknown_fields_error(names: list[str]) -> RequestError:
    """422 naming the first five unknown fields (cut to 60 characters each) and how many there are."""
    listed = ", ".join(shown(n, 60) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    count = f"{len(names)} unknown fields" if len(names) > 1 else "unknown field"
    return RequestError(
        f"{count} {listed}; the fields are {', '.join(FIELDS)}", ErrorCode.INVALID_SCHEMA, capped(names[0])
    )


_INPUT_SHAPE = (
    'an image (a data URL or base64 string), a text (with input_type "text"), or a non-empty list of them and of '
    '{"text": ...} / {"image": ...} objects'
)


def input_sentence(errors: list[dict]) -> str | None:
    """One sentence for what is wrong with `input`, in place of pydantic's one line per union branch
    (`input.str: Input should be a valid string; input.list[str]: List should have at least 1 item ...`);
    None when `input` is fine."""
    about = [e for e in errors if tuple(e.get("loc", ()))[:1] == ("input",)]
    if not about:
        return None
    if any(e.get("type") == "missing" for e in about):
        return f"input is required: {_INPUT_SHAPE}"
    listed = [e for e in about if str(tuple(e.get("loc", ()))[1:2]).startswith("('list[")]
    if any(e.get("type") == "too_short" for e in listed):
        return "input is an empty list; send at least one item"
    positions = sorted({e["loc"][2] for e in listed if len(e["loc"]) > 2 and isinstance(e["loc"][2], int)})
    if positions:
        shown = ", ".join(f"input[{i}]" for i in positions[:5]) + (", ..." if len(positions) > 5 else "")
        return f'{shown} must be a string or a {{"text": ...}} / {{"image": ...}} object'
    return f"input must be {_INPUT_SHAPE}"


def schema_error(errors: list[dict]) -> RequestError:
    """422 naming every schema violation (`pooling: Input should be ...; input is an empty list ...`)."""

    def where(e: dict) -> str:
        return ".".join(str(x) for x in e.get("loc", ()) if x != "body")

    sentence = input_sentence(errors)
    others = [e for e in errors if tuple(e.get("loc", ()))[:1] != ("input",)]
    unknown = [e for e in others if e.get("type") == "extra_forbidden"]
    others = [e for e in others if e.get("type") != "extra_forbidden"]
    parts = ([sentence] if sentence else []) + [f"{where(e) or 'body'}: {e.get('msg')}" for e in others]
    if unknown:
        names = ", ".join(shown(where(e), 60) for e in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        parts.append(f"unknown field{'s' if len(unknown) > 1 else ''} {names}; the fields are {', '.join(FIELDS)}")
    message = "; ".join(parts) or "invalid request body"
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    return RequestError(message, ErrorCode.INVALID_SCHEMA, capped(loc[0]) if loc else None)


def embedding_dtype_error(message: str) -> RequestError:
    return RequestError(message, ErrorCode.INVALID_EMBEDDING_DTYPE, "embedding_dtype")


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """The request body -> EmbeddingRequest; RequestError 400 (not JSON; a bad `embedding_dtype`) or 422 (schema)."""
    try:
        parsed = _Parsed.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        if any(x.get("type") == "json_invalid" for x in errors):
            detail = errors[0].get("msg", "").removeprefix("Invalid JSON: ")
            raise RequestError(f"the request body is not valid JSON: {detail}", ErrorCode.INVALID_JSON, None) from None
        if all(tuple(x.get("loc", ())) == ("embedding_dtype",) for x in errors):
            raise embedding_dtype_error(
                f"embedding_dtype must be one of {', '.join(EMBEDDING_DTYPES)} (a string)"
            ) from None
        raise schema_error(errors) from None
    if parsed.__pydantic_extra__:
        raise unknown_fields_error(list(parsed.__pydantic_extra__))
    if parsed.embedding_dtype != "float32" and parsed.encoding_format != "base64" and parsed.ec_cache_uuids is None:
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
    LLM output tuple (`deployments.llm_outputs.WireLLM`: tokens, DeepStack layers, patch grid, and a video's
    facts after the grid: Qwen3-VL's `timestamps`, Qwen2/2.5-VL's `second_per_grid_ts`)."""
    item: dict[str, Any] = {"object": "embedding", "index": index}
    if isinstance(out, tuple):
        vec, deepstack, grid = out[:3]
        item["shape"], item["grid_thw"] = list(vec.shape), list(grid)
        facts = video_facts(out)
        if "timestamps" in facts:
            item["timestamps"] = [float(s) for s in facts["timestamps"]]
        if "second_per_grid_ts" in facts:
            item["second_per_grid_ts"] = float(facts["second_per_grid_ts"])
        return item, vec, deepstack
    if out.ndim == 2:
        item["shape"] = list(out.shape)
    return item, out, []


def embeddings_body(outputs: list, encoding_format: str, model: str, patches: int, dtype: str = "float32") -> bytes:
    """The response body. `outputs`: per image a vector, a token matrix, or a `WireLLM` tuple (pooling=none:
    the item also carries `grid_thw`, for DeepStack models `deepstack`: one embedding per layer in the same
    encoding, and for a video `timestamps` (Qwen3-VL) or `second_per_grid_ts` (Qwen2/2.5-VL)). `dtype`: the
    base64 element type (`EmbeddingRequest.embedding_dtype`)."""
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


def ec_cache_body(items: list[dict], model: str, patches: int) -> bytes:
    """The answer to a request with `ec_cache_uuids`: per image what was written (`vllm_handoff.ec_cache_item`;
    the server's path is not named)."""
    usage = {"prompt_tokens": patches, "total_tokens": patches}
    data = [{k: v for k, v in item.items() if k != "path"} for item in items]
    return orjson.dumps({"object": "list", "data": data, "model": model, "usage": usage})


# Starlette's own HTTP errors (routing) by status; another status keeps it, with code "http_error".
_STARLETTE_ERRORS = {
    400: ErrorCode.INVALID_REQUEST,
    404: ErrorCode.ROUTE_NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
}

# FastAPI's own /docs, /redoc and /openapi.json would be open to anyone: the ingress serves /docs and
# /openapi.json itself, behind the API key when one is set (`HttpRoutes.openapi`, `docs`).
api = FastAPI(title="Vision encoding service", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(EncoderError)
async def _encoder_error(request: Request, exc: EncoderError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(RequestError("the request body is not valid JSON", ErrorCode.INVALID_JSON, None))
    return error_response(schema_error(list(errors)))


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    path = request.url.path if len(request.url.path) <= ECHO_LIMIT else request.url.path[:ECHO_LIMIT] + "…"
    message = f"{exc.detail} ({request.method} {path})"  # a 1 MB path is not echoed whole
    error = _STARLETTE_ERRORS.get(exc.status_code)
    type_, code = (error.type, error.code) if error is not None else (openai_type(exc.status_code), "http_error")
    return JSONResponse(
        error_body(message, type_, code, None), status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


@api.exception_handler(Exception)
async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)
