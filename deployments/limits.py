"""Request limits and admission control of the ingress (README "Limits, errors and security").

* `check_content_type`, `read_body`: JSON bodies only, with the byte limit enforced from Content-Length
  and while reading; `check_request_patches`: the patch total of one request.
* `Admission`: an in-flight request counter with immediate rejection (the ingress answers 429 at once
  instead of queueing without bound).
"""

from __future__ import annotations

from ray.serve.exceptions import BackPressureError

from .errors import ErrorCode, RequestError, shown


def check_request_patches(total: int, limit: int) -> None:
    if total > limit:
        raise RequestError(
            f"the images of this request have {total} patches after resizing; the limit is {limit}",
            ErrorCode.TOO_MANY_PATCHES,
        )


# ------------------------------------------------------------------------------------------ HTTP body


def check_content_type(value: str | None) -> None:
    """JSON bodies only (a missing Content-Type is read as JSON); else 415."""
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise RequestError(
        f"Content-Type {shown(media or value)} is not supported; send application/json",
        ErrorCode.UNSUPPORTED_CONTENT_TYPE,
        None,
    )


def request_too_large(size: int | str, limit: int) -> RequestError:
    return RequestError(
        f"the request body is {size} bytes, over the limit of {limit}", ErrorCode.REQUEST_TOO_LARGE, None
    )


async def read_body(request, limit: int) -> bytes:
    """The body of a Starlette request, refused (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise RequestError(f"invalid Content-Length {shown(declared)}", ErrorCode.INVALID_REQUEST, None) from None
        if size > limit:
            raise request_too_large(size, limit)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise request_too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------------------------------ admission


class Admission:
    """Requests in flight in one ingress replica, with immediate rejection above `limit`.

    Used from the replica's event loop only (no lock needed). `try_enter` never waits: a request
    over the limit is answered at once (429 + Retry-After), so overload costs the client one round trip.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self.inflight = 0
        self.peak = 0
        self.rejected = 0

    def try_enter(self) -> bool:
        if self.inflight >= self.limit:
            self.rejected += 1
            return False
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        return True

    def leave(self) -> None:
        self.inflight -= 1

    def overloaded(self, retry_after_s: float) -> BackPressureError:
        """The error a request refused by `try_enter` gets: 429 with Retry-After."""
        return BackPressureError(self.inflight, self.limit, status_code=429, retry_after_s=retry_after_s)
