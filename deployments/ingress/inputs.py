"""Opening one input image at the ingress, header first (README "Limits, errors and security").

`open_input` turns one input (a data URL or base64 string, encoded bytes, a PIL image, a uint8 array) into
an `Opened`: a lazily opened image after the checks that need only its header (encoded size, format
allowlist, pixel count) and its patch count. `finish_input` decodes and resizes it with
`encoder.preprocessing` (the same `load_image` and resize the model's own preprocessing runs). Between the
two the ingress checks the request's patch total, so nothing of an over-limit request is decoded.
`harden_pillow` (`encoder.preprocessing.images`) sets Pillow's own process-wide limits for the ingress process.
"""

from __future__ import annotations

import binascii
import io
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64
from PIL import Image

from deployments.errors import ErrorCode, RequestError
from encoder.errors import ImageDecodeError, ImageTooLargeError, InvalidImageError, VideoTooLargeError, reason
from encoder.preprocessing.config import ProcessorConfig
from encoder.preprocessing.image_guard import check_structure
from encoder.preprocessing.images import (
    canonical_format,
    check_image_size,
    harden_pillow,  # noqa: F401 - the ingress deployment's, the same as every process of ours that decodes
    load_image,
    text_chunks_refused,
)

# Declared media subtypes (data URL headers) -> Pillow format, to answer 415 for image types we do not read.
_MEDIA_FORMATS = {
    "png": "PNG", "apng": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "pjpeg": "JPEG", "webp": "WEBP", "gif": "GIF",
    "bmp": "BMP", "x-ms-bmp": "BMP", "tiff": "TIFF", "x-icon": "ICO", "vnd.microsoft.icon": "ICO", "svg+xml": "SVG",
    "heic": "HEIC", "heif": "HEIF", "avif": "AVIF", "jp2": "JPEG2000", "x-portable-pixmap": "PPM", "x-tga": "TGA",
    "vnd.adobe.photoshop": "PSD", "jxl": "JXL",
}  # fmt: skip
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,15}://")


def ingress_preprocess_config(model_pp: ProcessorConfig, max_image_pixels: int, formats) -> ProcessorConfig:
    """The model's preprocessing with the application's decode limits (pixels, formats) wired in."""
    return type(model_pp).model_validate(
        model_pp.model_dump() | {"max_image_pixels": max_image_pixels, "allowed_formats": frozenset(formats)}
    )


# ------------------------------------------------------------------------------------------ image strings


def is_url(text: str) -> bool:
    """`scheme://...`: never base64 (':' and '/' after letters cannot start a base64 image)."""
    return bool(_URL.match(text))


def image_too_large(size: int, limit: int, what: str = "image") -> RequestError:
    return RequestError(f"{what} is {size} bytes, over the limit of {limit} bytes", ErrorCode.IMAGE_TOO_LARGE)


def decode_base64(text: str) -> bytes:
    try:
        return pybase64.b64decode(text, validate=True)  # SIMD: ~60x the standard library's speed
    except (binascii.Error, ValueError):
        pass
    try:  # tolerate line breaks (MIME-style base64), nothing else
        return pybase64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"invalid base64 image data: {e}", ErrorCode.INVALID_BASE64) from None


def parse_image_string(text: str, max_bytes: int | None = None) -> tuple[bytes, str | None]:
    """A data URL (`data:image/png;base64,...`) or bare base64 -> (encoded image bytes, declared media type).

    `max_bytes`: the encoded-image limit, checked from the base64 length before decoding and exactly after.
    URLs are not handled here (RequestError 400); see `deployments.ingress.security.UrlFetcher`.
    """
    media = None
    if text[:5].lower() == "data:":
        header, comma, payload = text.partition(",")
        if not comma:
            raise RequestError("malformed data URL: no ',' before the data", ErrorCode.INVALID_DATA_URL)
        if len(header) > 256:
            raise RequestError("malformed data URL: header longer than 256 characters", ErrorCode.INVALID_DATA_URL)
        media, *params = (p.strip().lower() for p in header[5:].split(";"))
        if "base64" not in params:
            message = "data URLs must be base64-encoded ('data:image/png;base64,...')"
            raise RequestError(message, ErrorCode.INVALID_DATA_URL)
        if media and not media.startswith("image/"):
            raise RequestError(f"unsupported media type {media!r}; send an image", ErrorCode.UNSUPPORTED_MEDIA_TYPE)
        text = payload
    elif is_url(text):
        scheme = text.split(":", 1)[0].lower()
        raise RequestError(
            f"{scheme} image URLs are not fetched by this service; send a data URL or base64 image",
            ErrorCode.INVALID_IMAGE_URL,
        )
    if max_bytes is not None and (len(text) * 3) // 4 > max_bytes + max_bytes // 16 + 16:  # surely over
        raise image_too_large((len(text) * 3) // 4, max_bytes, "image (estimated from its base64 length)")
    data = decode_base64(text)
    if max_bytes is not None and len(data) > max_bytes:
        raise image_too_large(len(data), max_bytes)
    return data, media or None


def parse_video_string(text: str, max_bytes: int) -> bytes:
    """A video as a data URL (`data:video/mp4;base64,...`) or bare base64 -> its encoded bytes, within `max_bytes`
    (`VideoLimits.max_bytes`: 413 `video_too_large`, estimated from the base64 length before decoding). URLs:
    400 (videos are not fetched)."""
    if text[:5].lower() == "data:":
        header, comma, payload = text.partition(",")
        if not comma or len(header) > 256:
            raise RequestError("malformed data URL: no ',' within 256 characters", ErrorCode.INVALID_DATA_URL)
        media, *params = (p.strip().lower() for p in header[5:].split(";"))
        if "base64" not in params:
            raise RequestError("data URLs must be base64-encoded ('data:video/mp4;base64,...')",
                               ErrorCode.INVALID_DATA_URL)  # fmt: skip
        if media and not media.startswith("video/") and media != "application/octet-stream":
            raise RequestError(f"unsupported media type {media!r}; send a video", ErrorCode.UNSUPPORTED_MEDIA_TYPE)
        text = payload
    elif is_url(text):
        raise RequestError("video URLs are not fetched by this service; send a data URL or base64 video",
                           ErrorCode.INVALID_IMAGE_URL)  # fmt: skip
    if (len(text) * 3) // 4 > max_bytes + max_bytes // 16 + 16:
        raise VideoTooLargeError(f"video is about {(len(text) * 3) // 4} bytes (from its base64 length), over the "
                                 f"limit max_bytes={max_bytes}")  # fmt: skip
    data = decode_base64(text)
    if len(data) > max_bytes:
        raise VideoTooLargeError(f"video is {len(data)} bytes, over the limit max_bytes={max_bytes}")
    return data


# ------------------------------------------------------------------------------------------ header checks


@dataclass
class Opened:
    """One input after the header checks: what `load_image` gets next, and its patch count."""

    image: Any  # a lazily opened PIL image (nothing decoded yet), a PIL image or a uint8 array
    patches: int
    data: bytes | None = None  # the encoded bytes of an encoded input (what a decode process is sent)


def _allowed(pp: ProcessorConfig) -> list[str]:
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


def _unsupported(fmt: str, pp: ProcessorConfig) -> RequestError:
    allowed = ", ".join(sorted(pp.allowed_formats))
    return RequestError(
        f"image format {fmt} is not supported (supported: {allowed})", ErrorCode.UNSUPPORTED_IMAGE_FORMAT
    )


def open_image_bytes(data: bytes, pp: ProcessorConfig, media: str | None = None) -> Image.Image:
    """Parse the header of encoded image bytes with the allowed plugins only; check format and size.

    Raises ImageDecodeError (400) for empty or unidentifiable bytes, RequestError 415 for a format outside
    the allowlist (identified by header, or by the declared media type when no plugin reads it),
    ImageTooLargeError (413) above `pp.max_image_pixels` or for Pillow's decompression-bomb error,
    InvalidImageError (400) for zero sizes.
    """
    if not data:
        raise ImageDecodeError("image bytes are empty")
    # structure first (JPEG scan counts, chunk and frame counts): Pillow parses JPEG segments in Python,
    # and a progressive scan bomb passes every header check (`encoder.preprocessing.image_guard`)
    check_structure(data, pp.image_limits)
    try:
        img = Image.open(io.BytesIO(data), formats=_allowed(pp))  # the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLargeError(f"image refused as a decompression bomb: {reason(e)}") from None
    except Exception as e:  # noqa: BLE001 - Pillow plugins raise many types on garbage input
        if (refused := text_chunks_refused(e)) is not None:  # PNG text chunks before the pixel data
            raise refused from None
        fmt = _identify(data)
        if fmt is None and media:
            fmt = _MEDIA_FORMATS.get(media.removeprefix("image/"))
        if fmt is not None and canonical_format(fmt) not in pp.allowed_formats:
            raise _unsupported(fmt, pp) from None
        raise ImageDecodeError(f"cannot identify image data ({len(data)} bytes): {reason(e)}") from None
    if canonical_format(img.format) not in pp.allowed_formats:  # a plugin that registered under another name
        raise _unsupported(str(img.format), pp)
    check_image_size(img.width, img.height, pp)
    return img


def open_input(x: Any, pp: ProcessorConfig, max_image_bytes: int | None = None) -> Opened:
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
        return Opened(img, pp.num_patches(img.height, img.width), data)
    if isinstance(x, Image.Image):
        check_image_size(x.width, x.height, pp)
        return Opened(x, pp.num_patches(x.height, x.width))
    if isinstance(x, np.ndarray):
        if x.ndim in (2, 3) and x.dtype == np.uint8:
            check_image_size(x.shape[1], x.shape[0], pp)
            return Opened(x, pp.num_patches(x.shape[0], x.shape[1]))
        load_image(x, pp)  # 0-d, 1-D, object or float arrays: the precise InvalidImageError, now
        raise InvalidImageError(f"image arrays must be uint8 HxW or HxWxC, got {x.dtype} of shape {x.shape}")
    return Opened(x, 0)  # load_image raises the precise error


def finish_input(opened: Opened, pp: ProcessorConfig) -> np.ndarray:
    """Decode (the only full decode) and resize: uint8 [H, W, 3] at the smart_resize size."""
    return pp.resize(load_image(opened.image, pp))


def source_pixels(o: Opened) -> int:
    """Pixels of the opened input before resizing (a lazily opened PIL image knows its size)."""
    if isinstance(o.image, np.ndarray):
        return int(o.image.shape[0] * o.image.shape[1])
    width, height = getattr(o.image, "size", (1 << 16, 1 << 16))
    return int(width * height)
