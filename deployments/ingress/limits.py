"""Request limits and admission control of the ingress (README "Limits, errors and security").

* `check_content_type`, `read_body`: JSON bodies only, with the byte limit enforced from Content-Length
  and while reading, and a deadline for the body to arrive (a minimum rate); `check_request_patches`: the
  patch total of one request.
* `Admission`: what one ingress replica holds in flight (requests, request bytes with headers, patches),
  each bounded with immediate rejection (429 + Retry-After at once instead of queueing without bound).
"""

from __future__ import annotations

import asyncio

from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError
from starlette.requests import ClientDisconnect

from deployments.errors import ErrorCode, RequestError, shown


def check_request_patches(total: int, limit: int) -> None:
    if total > limit:
        raise RequestError(
            f"the images of this request have {total} patches after resizing; the limit is {limit}",
            ErrorCode.TOO_MANY_PATCHES,
        )


# ------------------------------------------------------------------------------------------ HTTP body


def check_content_type(value: str | None, encoding: str | None = None) -> None:
    """JSON bodies only (a missing Content-Type is read as JSON), not compressed (`Content-Encoding`); else 415.
    A gzip body read as JSON would be answered "not valid JSON", as if the client had sent bad JSON."""
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise RequestError(
            f"Content-Encoding {shown(encoding.strip())} is not supported; send the body uncompressed",
            ErrorCode.UNSUPPORTED_CONTENT_TYPE,
            None,
        )
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


# Bodies past this many bytes are gathered in one growing buffer (a list of chunks joined would hold the body
# twice at the end; a bytearray grows in place, by realloc, as bytes arrive).
_GATHER_BYTES = 1 * 2**20


def header_bytes(request) -> int:
    """Bytes of a Starlette request's headers (what the client sent of them, near enough), counted
    against the ingress's in-flight bytes as its body is."""
    return sum(len(k) + len(v) + 4 for k, v in request.headers.raw)


async def read_body(
    request, limit: int, reserve=None, timeout_s: float | None = None, min_rate: int = 1
) -> bytes | bytearray:
    """The body of a Starlette request, refused (413) as soon as it is known to exceed `limit` bytes.

    `reserve(n)` (optional) is called for each chunk before it is kept (the ingress's byte admission) and may
    refuse it. The body must arrive within `timeout_s` plus one second per `min_rate` bytes received (else
    408): a client trickling bytes cannot hold the connection for the whole request time limit. Only bytes
    received count, for the budget, the deadline and the memory held: a Content-Length is checked against
    `limit` and against what arrives, never reserved, so clients declaring 64 MiB and sending one byte hold
    one byte each, for `timeout_s`.
    """
    declared = request.headers.get("content-length")
    size = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise RequestError(f"invalid Content-Length {shown(declared)}", ErrorCode.INVALID_REQUEST, None) from None
        if size > limit:
            raise request_too_large(size, limit)
    loop = asyncio.get_running_loop()
    started = loop.time()
    # one chunk, the usual case, is returned as it came, without a copy; a big body goes into one bytearray
    buf: bytearray | None = None
    chunks: list[bytes] = []
    total = 0
    timer = asyncio.timeout_at(None if timeout_s is None else started + timeout_s)
    try:
        async with timer:
            async for chunk in request.stream():
                n = len(chunk)
                if total + n > limit or (size is not None and total + n > size):
                    raise request_too_large(f"more than {size if size is not None else limit}", limit)
                if reserve is not None:
                    reserve(n)
                if buf is not None:
                    buf += chunk
                elif total + n > _GATHER_BYTES:
                    buf = bytearray().join([*chunks, chunk])
                    chunks.clear()
                else:
                    chunks.append(chunk)
                total += n
                if timeout_s is not None:
                    timer.reschedule(started + timeout_s + total / min_rate)
    except (ClientDisconnect, TaskCancelledError):
        # the client went away mid-body (Starlette says so, or Serve's receive from its proxy was cancelled):
        # that is the request being cancelled (Serve cancels it next), not a server error to log
        raise asyncio.CancelledError from None
    except TimeoutError:
        if not timer.expired():
            raise
        raise RequestError(
            f"the request body did not arrive in time ({total} bytes in {loop.time() - started:.1f}s; a body has "
            f"{timeout_s:g}s plus 1s per {min_rate} bytes received)",
            ErrorCode.REQUEST_TIMEOUT, None,
        ) from None  # fmt: skip
    if size is not None and total < size:
        raise RequestError(
            f"the request body ended after {total} of the {size} bytes of its Content-Length",
            ErrorCode.INVALID_REQUEST, None,
        )  # fmt: skip
    if buf is not None:
        return buf  # what pydantic parses without another copy
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# ------------------------------------------------------------------------------------------ admission


class OverCapacityError(BackPressureError):
    """A request refused by `Admission` (429 + Retry-After): what this replica holds, and the limit."""

    def __init__(self, what: str, held: int, limit: int, retry_after_s: float | None = None):
        super().__init__(held, limit, 429, retry_after_s)
        self.what = what
        self._message = f"this ingress replica holds {held} {what} in flight, at its limit of {limit}"

    def __reduce__(self):  # its own arguments (Ray pickles it into the handle caller's process)
        return type(self), (self.what, self.num_queued_requests, self.max_queued_requests, self.retry_after_s)

    @property
    def num_queued_requests(self) -> int:
        return self.args[0]

    @property
    def max_queued_requests(self) -> int:
        return self.args[1]


class Ticket:
    """What one request holds of its ingress's admission budgets (released together by `Admission.leave`)."""

    __slots__ = ("bytes", "patches", "counted")

    def __init__(self) -> None:
        self.bytes, self.patches, self.counted = 0, 0, False


class Admission:
    """What one ingress replica holds in flight, with immediate rejection (429 + Retry-After) above a limit:
    requests being worked on (`limit`, counted once the body has arrived, so a slow body holds no slot), the
    bytes of requests (`max_bytes`: headers and body, reserved as they arrive), and their patches
    (`max_patches`: from the image headers, before decoding). A request alone is always let in by the two
    cost budgets (it was checked against the per-request limits), so no request is refused for ever.

    Used from the replica's event loop only (no lock needed). Nothing waits: a request over a limit is
    answered at once, so overload costs the client one round trip.
    """

    def __init__(self, limit: int, max_bytes: int | None = None, max_patches: int | None = None, retry_after_s=None):
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit, self.max_bytes, self.max_patches = limit, max_bytes, max_patches
        self.retry_after_s = retry_after_s
        self.inflight = self.peak = self.rejected = 0
        self.bytes = self.peak_bytes = self.patches = 0
        self.rejected_bytes = self.rejected_patches = 0

    def try_enter(self, ticket: Ticket | None = None) -> bool:
        if self.inflight >= self.limit:
            self.rejected += 1
            return False
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        if ticket is not None:
            ticket.counted = True
        return True

    def enter(self, ticket: Ticket) -> None:
        """`try_enter`, raising `overloaded()` when refused."""
        if not self.try_enter(ticket):
            raise self.overloaded(self.retry_after_s)

    def reserve_bytes(self, ticket: Ticket, n: int) -> None:
        """Hold `n` more bytes for `ticket`'s request, or raise OverCapacityError (429). A request alone (no other
        holds bytes) is always let in: its headers, then its body, in as many parts as they come."""
        others = self.bytes - ticket.bytes
        if self.max_bytes is not None and others and self.bytes + n > self.max_bytes:
            self.rejected_bytes += 1
            raise OverCapacityError("bytes of requests", self.bytes, self.max_bytes, self.retry_after_s)
        self.bytes += n
        ticket.bytes += n
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def release_bytes(self, ticket: Ticket) -> None:
        """The request no longer holds its bytes (its body was parsed and dropped)."""
        self.bytes -= ticket.bytes
        ticket.bytes = 0

    def reserve_patches(self, ticket: Ticket, n: int) -> None:
        """Hold `n` patches for `ticket`'s request (decode to answer), or raise OverCapacityError (429); a request
        alone is always let in."""
        others = self.patches - ticket.patches
        if self.max_patches is not None and others and self.patches + n > self.max_patches:
            self.rejected_patches += 1
            raise OverCapacityError("patches of requests", self.patches, self.max_patches, self.retry_after_s)
        self.patches += n
        ticket.patches += n

    def leave(self, ticket: Ticket | None = None) -> None:
        """Release everything the request holds (without a ticket: its request slot)."""
        if ticket is None:
            self.inflight -= 1
            return
        if ticket.counted:
            self.inflight -= 1
            ticket.counted = False
        self.release_bytes(ticket)
        self.patches -= ticket.patches
        ticket.patches = 0

    def overloaded(self, retry_after_s: float) -> BackPressureError:
        """The error a request refused by `try_enter` gets: 429 with Retry-After."""
        return BackPressureError(self.inflight, self.limit, status_code=429, retry_after_s=retry_after_s)

    def snapshot(self) -> dict:
        return {
            "rejected_overload": self.rejected, "inflight": self.inflight, "peak_inflight": self.peak,
            "inflight_limit": self.limit, "inflight_bytes": self.bytes, "peak_inflight_bytes": self.peak_bytes,
            "inflight_patches": self.patches, "rejected_bytes": self.rejected_bytes,
            "rejected_patches": self.rejected_patches,
        }  # fmt: skip
