"""Request limits, admission control and retries of the ingress (README "Limits, errors and security").

* Inputs: `open_input` turns one input into a lazily opened image after checking, from the header only,
  the encoded size, the format allowlist, the pixel count and the aspect ratio, and counts its patches;
  `finish_input` decodes and resizes it. Between the two the ingress checks the request's patch total, so
  nothing of an over-limit request is decoded. `harden_pillow` sets Pillow's own process-wide limits.
* `Admission`: an in-flight request counter with immediate rejection (the ingress answers 429 at once
  instead of queueing without bound).
* `call_with_retries`: retries an idempotent encoder call when its replica died or is unavailable.
* `read_body`: the HTTP body with its byte limit enforced from Content-Length and while reading.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from PIL import Image, PngImagePlugin

from encoder.errors import ImageDecodeError, ImageTooLargeError, InvalidImageError
from encoder.preprocess import PreprocessConfig, load_image
from encoder.preprocess_vit import num_patches_for, resize_image_for

from .openai_api import UNAVAILABLE_ERRORS, RequestError, image_too_large, parse_image_string

T = TypeVar("T")

# Pillow reports multi-picture JPEGs (phone cameras) as MPO: they are JPEG files to users.
_ALIASES = {"MPO": "JPEG"}
# Declared media subtypes (data URL headers) -> Pillow format, to answer 415 for image types we do not read.
_MEDIA_FORMATS = {
    "png": "PNG", "apng": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "pjpeg": "JPEG", "webp": "WEBP", "gif": "GIF",
    "bmp": "BMP", "x-ms-bmp": "BMP", "tiff": "TIFF", "x-icon": "ICO", "vnd.microsoft.icon": "ICO", "svg+xml": "SVG",
    "heic": "HEIC", "heif": "HEIF", "avif": "AVIF", "jp2": "JPEG2000", "x-portable-pixmap": "PPM", "x-tga": "TGA",
    "vnd.adobe.photoshop": "PSD", "jxl": "JXL",
}  # fmt: skip
PNG_TEXT_MEMORY = 8 * 2**20


def harden_pillow(max_image_pixels: int) -> None:
    """Process-wide Pillow limits for the ingress (its own process): the decompression-bomb threshold
    (Pillow raises above twice it; `open_input` refuses anything above it from the header) and the memory
    that PNG text chunks may decompress to (Pillow's default is 64 MiB per image)."""
    Image.MAX_IMAGE_PIXELS = max_image_pixels
    PngImagePlugin.MAX_TEXT_MEMORY = min(PngImagePlugin.MAX_TEXT_MEMORY, PNG_TEXT_MEMORY)


def ingress_preprocess_config(model_pp: PreprocessConfig, max_image_pixels: int, formats) -> PreprocessConfig:
    """The model's preprocessing with the application's decode limits (pixels, formats) wired in."""
    return type(model_pp).model_validate(
        model_pp.model_dump() | {"max_image_pixels": max_image_pixels, "allowed_formats": frozenset(formats)}
    )


@dataclass
class Opened:
    """One input after the header checks: what `load_image` gets next, and its patch count."""

    image: Any  # a lazily opened PIL image (nothing decoded yet), a PIL image or a uint8 array
    patches: int


def _allowed(pp: PreprocessConfig) -> list[str]:
    """Plugin names for `Image.open(formats=...)` (the JPEG plugin also opens MPO files)."""
    Image.init()
    return sorted(f for f in pp.allowed_formats if f in Image.OPEN)


def _identify(data: bytes) -> str | None:
    """The format of bytes no allowed plugin accepts (header parse only; for the 415 message)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.format
    except Exception:  # noqa: BLE001 - unidentifiable bytes
        return None


def _unsupported(fmt: str, pp: PreprocessConfig) -> RequestError:
    allowed = ", ".join(sorted(pp.allowed_formats))
    return RequestError(f"image format {fmt} is not supported (supported: {allowed})", 415, "unsupported_image_format")


def open_image_bytes(data: bytes, pp: PreprocessConfig, media: str | None = None) -> Image.Image:
    """Parse the header of encoded image bytes with the allowed plugins only; check format and size.

    Raises ImageDecodeError (400) for empty or unidentifiable bytes, RequestError 415 for a format outside
    the allowlist (identified by header, or by the declared media type when no plugin reads it),
    ImageTooLargeError (413) above `pp.max_image_pixels` or for Pillow's decompression-bomb error,
    InvalidImageError (400) for zero sizes.
    """
    if not data:
        raise ImageDecodeError("image bytes are empty")
    try:
        img = Image.open(io.BytesIO(data), formats=_allowed(pp))  # the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLargeError(f"image refused as a decompression bomb: {e}") from None
    except Exception as e:  # noqa: BLE001 - Pillow plugins raise many types on garbage input
        fmt = _identify(data)
        if fmt is None and media:
            fmt = _MEDIA_FORMATS.get(media.removeprefix("image/"))
        if fmt is not None and _ALIASES.get(fmt, fmt) not in pp.allowed_formats:
            raise _unsupported(fmt, pp) from None
        raise ImageDecodeError(f"cannot identify image data ({len(data)} bytes): {e}") from None
    fmt = _ALIASES.get(img.format or "", img.format)
    if fmt not in pp.allowed_formats:  # a plugin that registered under another name
        raise _unsupported(str(img.format), pp)
    _check_size(img.width, img.height, pp)
    return img


def _check_size(width: int, height: int, pp: PreprocessConfig) -> None:
    if width <= 0 or height <= 0:
        raise InvalidImageError(f"image has zero size ({width}x{height})")
    if width * height > pp.max_image_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {pp.max_image_pixels}"
        )


def open_input(x: Any, pp: PreprocessConfig, max_image_bytes: int | None = None) -> Opened:
    """One input (data URL / base64 str, encoded bytes, PIL image, uint8 array) -> `Opened`, no pixels decoded.

    Encoded images: byte limit, format allowlist, pixel limit (header), aspect ratio and patch count.
    Decoded inputs (PIL, arrays): pixel limit and patch count; `load_image` validates the rest.
    """
    media = None
    if isinstance(x, str):
        x, media = parse_image_string(x, max_image_bytes)
    if isinstance(x, bytes | bytearray | memoryview):
        data = bytes(x)
        if max_image_bytes is not None and len(data) > max_image_bytes:
            raise image_too_large(len(data), max_image_bytes)
        img = open_image_bytes(data, pp, media)
        return Opened(img, num_patches_for(img.height, img.width, pp))
    if isinstance(x, Image.Image):
        _check_size(x.width, x.height, pp)
        return Opened(x, num_patches_for(x.height, x.width, pp))
    if isinstance(x, np.ndarray) and x.ndim in (2, 3) and x.dtype == np.uint8:
        _check_size(x.shape[1], x.shape[0], pp)
        return Opened(x, num_patches_for(x.shape[0], x.shape[1], pp))
    return Opened(x, 0)  # load_image raises the precise error


def finish_input(opened: Opened, pp: PreprocessConfig) -> np.ndarray:
    """Decode (the only full decode) and resize: uint8 [H, W, 3] at the smart_resize size."""
    return resize_image_for(load_image(opened.image, pp), pp)


def check_request_patches(total: int, limit: int) -> None:
    if total > limit:
        raise RequestError(
            f"the images of this request have {total} patches after resizing; the limit is {limit}",
            413,
            "too_many_patches",
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
        f"Content-Type {media or value!r} is not supported; send application/json",
        415,
        "unsupported_content_type",
        None,
    )


def request_too_large(size: int | str, limit: int) -> RequestError:
    return RequestError(f"the request body is {size} bytes, over the limit of {limit}", 413, "request_too_large", None)


async def read_body(request, limit: int) -> bytes:
    """The body of a Starlette request, refused (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise RequestError(f"invalid Content-Length {declared!r}", 400, "invalid_request", None) from None
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


# ------------------------------------------------------------------------------------------ retries


def is_unavailable(exc: BaseException) -> bool:
    """The encoder replica died or could not be reached (as opposed to an error the request caused)."""
    return isinstance(exc, UNAVAILABLE_ERRORS)


def backoff_s(attempt: int, base_s: float, cap_s: float = 2.0) -> float:
    """Delay before retry `attempt` (1-based): base * 2^(attempt-1), capped, with +-50% jitter."""
    return min(cap_s, base_s * 2 ** (attempt - 1)) * (0.5 + random.random())


async def call_with_retries(
    call: Callable[[], Awaitable[T]],
    retries: int,
    base_s: float,
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> T:
    """`await call()`, again (at most `retries` times, with backoff) when it fails with an unavailable-replica
    error. Only for idempotent calls. Other errors (the request's own, backpressure) propagate at once."""
    attempt = 0
    while True:
        try:
            return await call()
        except UNAVAILABLE_ERRORS as e:
            if attempt >= retries:
                raise
            attempt += 1
            if on_retry is not None:
                on_retry(e, attempt)
            await asyncio.sleep(backoff_s(attempt, base_s))


# ------------------------------------------------------------------------------------------ memory


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm; 0 where it does not exist)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
