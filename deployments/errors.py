"""What a request can end in, and how each ending is answered.

`ErrorCode` is the one table: every error the service answers has a member, and the member says the
OpenAI error `code` clients see, the HTTP status, the OpenAI error `type` and the metrics outcome. A
raise site names a member (`RequestError("...", ErrorCode.TOO_MANY_IMAGES)`), never a status; `classify`
maps any exception (ours, the encoder's, Ray's) onto a member. Nothing here imports FastAPI or builds an
app: the HTTP module (`deployments.ingress.openai_api`) and the handle path both read this module.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from encoder.errors import (
    ConfigError,
    DecodeTimeoutError,
    EncoderError,
    ImageDecodeError,
    ImageTooComplexError,
    ImageTooLargeError,
    InvalidArgumentError,
    InvalidImageError,
    InvalidVideoError,
    VideoDecodeError,
    VideoTooLargeError,
)

# OpenAI error types
_INVALID = "invalid_request_error"
_AUTH = "authentication_error"
_RATE = "rate_limit_error"
_SERVER = "server_error"

# metrics outcomes (`vision_requests{outcome=...}`) and the ingress counters they feed
OK = "ok"
CLIENT_ERROR = "client_error"
OVERLOADED = "overloaded"
TIMED_OUT = "timeout"
SERVER_ERROR = "server_error"
DISCONNECTED = "disconnected"  # the caller went away (HTTP client disconnected, handle call cancelled): no answer
# inside `ErrorCode` the name OVERLOADED is the member once it is defined: later rows use this alias
_OVERLOADED_OUTCOME = OVERLOADED


class ErrorCode(Enum):
    """Every error answer: (OpenAI `code`, HTTP status, OpenAI `type`, metrics outcome)."""

    # -- the request is malformed (400) ------------------------------------------------------------------
    INVALID_REQUEST = ("invalid_request", 400, _INVALID, CLIENT_ERROR)
    INVALID_JSON = ("invalid_json", 400, _INVALID, CLIENT_ERROR)
    INVALID_BASE64 = ("invalid_base64", 400, _INVALID, CLIENT_ERROR)
    INVALID_DATA_URL = ("invalid_data_url", 400, _INVALID, CLIENT_ERROR)
    INVALID_IMAGE_URL = ("invalid_image_url", 400, _INVALID, CLIENT_ERROR)
    URL_NOT_ALLOWED = ("url_not_allowed", 400, _INVALID, CLIENT_ERROR)
    IMAGE_FETCH_FAILED = ("image_fetch_failed", 400, _INVALID, CLIENT_ERROR)
    INVALID_IMAGE = ("invalid_image", 400, _INVALID, CLIENT_ERROR)
    INVALID_ARGUMENT = ("invalid_argument", 400, _INVALID, CLIENT_ERROR)
    # a pooling name of some family that the served model does not offer; a name of none is 422 INVALID_SCHEMA
    INVALID_POOLING = ("invalid_pooling", 400, _INVALID, CLIENT_ERROR)
    INVALID_DIMENSIONS = ("invalid_dimensions", 400, _INVALID, CLIENT_ERROR)
    INVALID_EMBEDDING_DTYPE = ("invalid_embedding_dtype", 400, _INVALID, CLIENT_ERROR)
    INVALID_TEXT = ("invalid_text", 400, _INVALID, CLIENT_ERROR)  # a text item empty or not a string
    TEXT_NOT_SUPPORTED = ("text_not_supported", 400, _INVALID, CLIENT_ERROR)  # the served model has no text tower
    INVALID_VIDEO = ("invalid_video", 400, _INVALID, CLIENT_ERROR)  # not a video we decode, truncated, no frames
    VIDEO_NOT_SUPPORTED = ("video_not_supported", 400, _INVALID, CLIENT_ERROR)  # the served tower takes no video
    # `embedding_layout` "vllm" where it makes no sense (a non-Qwen tower, a pooling other than "none", texts)
    INVALID_LAYOUT = ("invalid_layout", 400, _INVALID, CLIENT_ERROR)
    # an `ec_cache_uuids` entry that is no safe directory name, a repeated one, or a count unlike the images'
    INVALID_UUID = ("invalid_uuid", 400, _INVALID, CLIENT_ERROR)
    # `ec_cache_uuids` sent to a service without `ec_cache_dir`
    EC_CACHE_NOT_CONFIGURED = ("ec_cache_not_configured", 400, _INVALID, CLIENT_ERROR)
    # -- the caller is not let in (401) ---------------------------------------------------------------------
    MISSING_API_KEY = ("missing_api_key", 401, _AUTH, CLIENT_ERROR)
    INVALID_API_KEY = ("invalid_api_key", 401, _AUTH, CLIENT_ERROR)
    # -- what was asked for does not exist here (404, 405) ----------------------------------------------------
    MODEL_NOT_FOUND = ("model_not_found", 404, _INVALID, CLIENT_ERROR)
    ROUTE_NOT_FOUND = ("not_found", 404, _INVALID, CLIENT_ERROR)
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, _INVALID, CLIENT_ERROR)
    # -- the body did not arrive in time (408) ------------------------------------------------------------
    REQUEST_TIMEOUT = ("request_timeout", 408, _INVALID, TIMED_OUT)
    # -- over a limit (413), of a kind not read (415), against the schema (422) --------------------------------
    IMAGE_TOO_LARGE = ("image_too_large", 413, _INVALID, CLIENT_ERROR)
    VIDEO_TOO_LARGE = ("video_too_large", 413, _INVALID, CLIENT_ERROR)  # over a video limit (`VideoLimits`)
    IMAGE_TOO_COMPLEX = ("image_too_complex", 413, _INVALID, CLIENT_ERROR)  # structure over a limit (JPEG scans...)
    IMAGE_DECODE_TIMEOUT = ("image_decode_timeout", 413, _INVALID, CLIENT_ERROR)  # its decode overran the deadline
    TOO_MANY_IMAGES = ("too_many_images", 413, _INVALID, CLIENT_ERROR)
    TOO_MANY_PATCHES = ("too_many_patches", 413, _INVALID, CLIENT_ERROR)
    REQUEST_TOO_LARGE = ("request_too_large", 413, _INVALID, CLIENT_ERROR)
    UNSUPPORTED_MEDIA_TYPE = ("unsupported_media_type", 415, _INVALID, CLIENT_ERROR)
    UNSUPPORTED_CONTENT_TYPE = ("unsupported_content_type", 415, _INVALID, CLIENT_ERROR)
    UNSUPPORTED_IMAGE_FORMAT = ("unsupported_image_format", 415, _INVALID, CLIENT_ERROR)
    INVALID_SCHEMA = ("invalid_schema", 422, _INVALID, CLIENT_ERROR)
    # -- the service cannot take it now (429, 503) -------------------------------------------------------------
    RATE_LIMITED = ("overloaded", 429, _RATE, OVERLOADED)  # this ingress replica is at its in-flight limit
    OVERLOADED = ("overloaded", 503, _SERVER, OVERLOADED)  # a Serve queue is full
    ENCODER_UNAVAILABLE = ("encoder_unavailable", 503, _SERVER, _OVERLOADED_OUTCOME)  # retries ran out
    SHUTTING_DOWN = ("shutting_down", 503, _SERVER, _OVERLOADED_OUTCOME)  # draining (deployments.shutdown)
    # -- the service failed (500, 504) ---------------------------------------------------------------------------
    INTERNAL_ERROR = ("internal_error", 500, _SERVER, SERVER_ERROR)
    TIMEOUT = ("timeout", 504, _SERVER, TIMED_OUT)

    def __init__(self, code: str, status: int, type_: str, outcome: str):
        self.code, self.status, self.type, self.outcome = code, status, type_, outcome

    @property
    def retry_after(self) -> bool:
        """Answers that tell the client when to come back (`Retry-After`)."""
        return self.status in (429, 503)


ECHO_LIMIT = 100  # characters of a client's value repeated in an error message


def shown(value: object, limit: int = ECHO_LIMIT) -> str:
    """`repr` of a value a client sent, cut to `limit` characters + '…' (a 1 MB model name is not echoed)."""
    text = value if isinstance(value, str) else str(value)
    return repr(text if len(text) <= limit else text[:limit] + "…")


def capped(value: str | None, limit: int = ECHO_LIMIT) -> str | None:
    """A client's value as an error's `param`: at most `limit` characters + '…' (a 1 MB field name is not
    echoed)."""
    return value if value is None or len(value) <= limit else value[:limit] + "…"


def openai_type(status: int) -> str:
    """The OpenAI error type of a status that no `ErrorCode` names (Starlette's own HTTP errors)."""
    return {401: _AUTH, 429: _RATE}.get(status, _INVALID if status < 500 else _SERVER)


class RequestError(InvalidArgumentError):
    """A client mistake the ingress detects itself (bad base64, data URL, media type, limits, API key)."""

    def __init__(self, message: str, error: ErrorCode = ErrorCode.INVALID_REQUEST, param: str | None = "input"):
        super().__init__(message)
        self.error, self.param = error, param

    @property
    def status(self) -> int:
        return self.error.status

    @property
    def code(self) -> str:
        return self.error.code


def text_off_error(model_name: str) -> RequestError:
    """400 `text_not_supported` for text sent to an application that serves images only (`AppArgs.text` False),
    whatever its model could do: the ingress and the replica say it alike."""
    return RequestError(
        f"text is off for this deployment: it serves the model {model_name!r} for images only (application "
        "argument text=false)",
        ErrorCode.TEXT_NOT_SUPPORTED, "input",
    )  # fmt: skip


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


class Classified(NamedTuple):
    error: ErrorCode
    param: str | None


def root_cause(exc: BaseException) -> BaseException:
    """The user exception inside a Ray task error raised by a replica (Ray keeps it as `.cause`)."""
    seen = 0
    while isinstance(getattr(exc, "cause", None), BaseException) and seen < 8:
        exc, seen = exc.cause, seen + 1
    return exc


def classify(exc: BaseException) -> Classified:
    """The answer to a request that raised `exc`: its `ErrorCode` and the request field it names."""
    exc = root_cause(exc)
    if isinstance(exc, RequestError):
        return Classified(exc.error, exc.param)
    if isinstance(exc, VideoTooLargeError):
        return Classified(ErrorCode.VIDEO_TOO_LARGE, "input")
    if isinstance(exc, VideoDecodeError | InvalidVideoError):
        return Classified(ErrorCode.INVALID_VIDEO, "input")
    if isinstance(exc, DecodeTimeoutError):
        return Classified(ErrorCode.IMAGE_DECODE_TIMEOUT, "input")
    if isinstance(exc, ImageTooComplexError):
        return Classified(ErrorCode.IMAGE_TOO_COMPLEX, "input")
    if isinstance(exc, ImageTooLargeError):
        return Classified(ErrorCode.IMAGE_TOO_LARGE, "input")
    if isinstance(exc, ImageDecodeError | InvalidImageError):
        return Classified(ErrorCode.INVALID_IMAGE, "input")
    if isinstance(exc, InvalidArgumentError):
        return Classified(ErrorCode.INVALID_ARGUMENT, None)
    if isinstance(exc, EncoderError) and not isinstance(exc, ConfigError):
        return Classified(ErrorCode.INVALID_REQUEST, None)
    if isinstance(exc, BackPressureError):
        return Classified(ErrorCode.RATE_LIMITED if exc.status_code == 429 else ErrorCode.OVERLOADED, None)
    if isinstance(exc, UNAVAILABLE_ERRORS):
        return Classified(ErrorCode.ENCODER_UNAVAILABLE, None)
    if isinstance(exc, TimeoutError):
        return Classified(ErrorCode.TIMEOUT, None)
    return Classified(ErrorCode.INTERNAL_ERROR, None)


def with_index(exc: EncoderError, where: str) -> EncoderError:
    """The same error type with the input position prefixed to its message."""
    if isinstance(exc, RequestError):
        return RequestError(f"{where}: {exc}", exc.error, exc.param)
    try:
        new = type(exc)(f"{where}: {exc}")
    except Exception:  # noqa: BLE001 - an exception type with another constructor: keep the original
        return exc
    new.__cause__ = exc
    return new
