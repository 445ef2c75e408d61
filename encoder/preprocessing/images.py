"""Image inputs for every family's preprocessing (Pillow and numpy, no torch): decoding, the checks on
untrusted bytes, the RGB rule, and the accepted formats.

`load_image` turns one input (encoded bytes, a PIL image, a uint8 array) into an RGB PIL image; the family's
config then resizes it (`cfg.resize`: `encoder.preprocessing.qwen`, `encoder.preprocessing.vit`). Details that
matter for exactness (mirrored from transformers 5.x):
  * RGB conversion: images with an alpha band or a `transparency` entry are alpha-composited onto white;
    everything else goes through PIL's `convert("RGB")` (CMYK uses PIL's naive formula). uint8 arrays become
    L/RGB/RGBA images and follow the same rule.
  * Wider-than-8-bit grayscale (our rule, not transformers': PIL's `convert` saturates every value above 255,
    so different pictures became the same white image): 16-bit modes (I;16, I;16L, I;16B, I;16N) keep their
    high byte (`value >> 8`, what Pillow itself does when it opens a 16-bit RGB, RGBA or gray+alpha PNG, so a
    16-bit gray PNG gives the same pixels as the same picture saved as 16-bit RGB); a 16-bit `transparency`
    value is compared before the shift. Mode I (32-bit integer) follows the same rule when its values are
    within 0..65535 and is refused otherwise; mode F (32-bit float) is refused: float pixels have no defined
    range (1.0, 255 or 65535 may be white). Both refusals are InvalidImageError naming the mode.
  * EXIF orientation is applied to PIL and bytes inputs.
Untrusted bytes are checked before full decode: structure (`encoder.preprocessing.image_guard`: JPEG scan counts,
chunk and frame counts, CPU bombs), format allowlist, header size (decompression bombs).

What these functions read of a config (`max_image_pixels`, `allowed_formats`, `image_limits`) both families'
configs have; `DecodeLimits` holds just those, with the defaults the configs share.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, PngImagePlugin, UnidentifiedImageError

from encoder.errors import ImageDecodeError, ImageTooComplexError, ImageTooLargeError, InvalidImageError, reason
from encoder.preprocessing.image_guard import DEFAULT_LIMITS, ImageLimits, check_structure

DEFAULT_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"})
DEFAULT_MAX_IMAGE_PIXELS = 100_000_000
# Pillow reports multi-picture JPEGs (most phone cameras) as "MPO"; they are JPEG files to users.
_FORMAT_ALIASES = {"MPO": "JPEG"}
_ORIENTATION = 0x0112  # the EXIF tag
# What PNG text chunks (tEXt, zTXt, iTXt) may decompress to per image in our processes (`harden_pillow`);
# Pillow's default is 64 MiB, from a file of a few KB.
PNG_TEXT_MEMORY = 8 * 2**20
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


@dataclass(frozen=True)
class DecodeLimits:
    """The settings `load_image` reads (every preprocessing config has them too)."""

    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_formats: frozenset[str] = DEFAULT_FORMATS
    image_limits: ImageLimits = DEFAULT_LIMITS


DEFAULT_DECODE_LIMITS = DecodeLimits()


def known_formats(v) -> frozenset[str]:
    """Validator shared by the preprocessing configs: a non-empty set of Pillow format names, upper-cased."""
    Image.init()
    v = frozenset(f.upper() for f in v)
    unknown = sorted(v - set(Image.OPEN))
    if not v or unknown:
        raise ValueError(f"allowed_formats must be non-empty Pillow format names; unknown: {unknown}")
    return v


def load_image(x: Any, cfg: DecodeLimits = DEFAULT_DECODE_LIMITS) -> Image.Image:
    """Decode/convert one input to an RGB PIL image (EXIF orientation applied for PIL/bytes inputs)."""
    if isinstance(x, bytes | bytearray | memoryview):
        img = _decode(bytes(x), cfg)
    elif isinstance(x, Image.Image):
        check_image_size(x.width, x.height, cfg)
        _check_mode(x.mode)  # before a lazily opened image is decoded
        img = _load(x)  # a lazily opened image may still hold undecoded (possibly truncated) data
    elif isinstance(x, np.ndarray):
        return _from_array(x, cfg)
    elif isinstance(x, str):
        raise InvalidImageError("got a str; paths and URLs are not accepted, pass the encoded image bytes")
    else:
        raise InvalidImageError(
            f"unsupported image type {type(x).__name__}; expected bytes, PIL.Image.Image or uint8 numpy array"
        )
    return _to_rgb(_exif_transpose(img))


def check_image_size(width: int, height: int, cfg: DecodeLimits) -> None:
    """InvalidImageError for a zero side, ImageTooLargeError above `cfg.max_image_pixels` (header facts only)."""
    if width <= 0 or height <= 0:
        raise InvalidImageError(f"image has zero size ({width}x{height})")
    if width * height > cfg.max_image_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {cfg.max_image_pixels}"
        )


def canonical_format(pillow_format: str | None) -> str | None:
    """The format name users know for a Pillow format (an MPO file is a JPEG)."""
    return _FORMAT_ALIASES.get(pillow_format or "", pillow_format)


def _decode(data: bytes, cfg: DecodeLimits) -> Image.Image:
    if not data:
        raise ImageDecodeError("image bytes are empty")
    # Before Image.open: Pillow parses JPEG segments up to the first scan in Python (100,000 empty
    # comment segments, 400 KB, take its Image.open 0.3 s), so the guard must come first.
    check_structure(data, cfg.image_limits)
    try:
        img = Image.open(io.BytesIO(data))  # parses the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # The warning only arrives as an exception if the caller's warning filters say so; we never
        # touch the (process-global, thread-unsafe) filters ourselves.
        raise ImageTooLargeError(f"image refused as a decompression bomb: {reason(e)}") from e
    except UnidentifiedImageError as e:  # no plugin recognised the header
        raise ImageDecodeError(
            f"cannot identify image data ({len(data)} bytes): not an image in a known format "
            f"(accepted: {', '.join(sorted(cfg.allowed_formats))})"
        ) from e
    except Exception as e:  # Pillow plugins raise many types on garbage input
        if (refused := text_chunks_refused(e)) is not None:  # text chunks before the pixel data
            raise refused from e
        raise ImageDecodeError(f"cannot identify image data ({len(data)} bytes): {reason(e)}") from e
    if canonical_format(img.format) not in cfg.allowed_formats:
        raise ImageDecodeError(
            f"image format {img.format} is not allowed (allowed: {', '.join(sorted(cfg.allowed_formats))})"
        )
    check_image_size(img.width, img.height, cfg)  # before .load(): nothing big allocated yet
    _check_mode(img.mode)  # the header tells: refused before the pixels are decoded
    return _load(img)


def _load(img: Image.Image) -> Image.Image:
    try:
        img.load()  # Image.open is lazy; force the full decode so truncation is caught here
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLargeError(f"image refused as a decompression bomb: {reason(e)}") from e
    except Exception as e:
        if (refused := text_chunks_refused(e)) is not None:  # text chunks after the pixel data
            raise refused from e
        raise ImageDecodeError(f"{img.format or img.mode} image is truncated or corrupt: {reason(e)}") from e
    return img


def text_chunks_refused(e: BaseException) -> ImageTooComplexError | None:
    """Pillow's refusal of PNG text chunks over `PngImagePlugin.MAX_TEXT_MEMORY` (all of an image's) or
    `MAX_TEXT_CHUNK` (one chunk), worded as our limit; None for any other error. Pillow raises a bare
    ValueError whose message names the setting: that name is the only way to tell."""
    text = str(e)
    if not isinstance(e, ValueError) or "MAX_TEXT_" not in text:
        return None
    return ImageTooComplexError(
        f"PNG text chunks (zTXt, iTXt, tEXt) decompress to more than the limit of "
        f"{PngImagePlugin.MAX_TEXT_MEMORY} bytes per image ({PngImagePlugin.MAX_TEXT_CHUNK} per chunk): {text}"
    )


def harden_pillow(max_image_pixels: int | None = None) -> None:
    """Pillow's process-wide limits, for every process of ours that decodes untrusted images (the ingress, its
    decode workers, the batch job's decode tasks, the CLI), called where the process starts (idempotent):
      * what PNG text chunks may decompress to: `PNG_TEXT_MEMORY` per image (Pillow's default is 64 MiB;
        never raised), refused as ImageTooComplexError (a process without it accepted 60 MB of zTXt);
      * with `max_image_pixels` (the process's own limit), Pillow's decompression-bomb threshold at it, so
        Pillow's error (at twice it) never refuses an image our limit lets through;
      * `ignore_pillow_bomb_warning`.
    Module globals of Pillow: a process that decodes with two limits gets the last one's threshold. Library
    callers' processes (`VisionEncoder`) keep their own Pillow settings: it is not called there."""
    if max_image_pixels is not None:
        Image.MAX_IMAGE_PIXELS = max_image_pixels
    ignore_pillow_bomb_warning()
    PngImagePlugin.MAX_TEXT_MEMORY = min(PngImagePlugin.MAX_TEXT_MEMORY, PNG_TEXT_MEMORY)


def ignore_pillow_bomb_warning() -> None:
    """For a process of ours that checks every image against its own `max_image_pixels` from the header right
    after `Image.open` (the ingress, its decode workers, the batch job's processes, the CLI): ignore Pillow's
    `DecompressionBombWarning`, which `Image.open` prints for an image over `PIL.Image.MAX_IMAGE_PIXELS` before
    that check runs, so a refused image still logged it. Our limit decides (and refuses with a clear error);
    Pillow's `DecompressionBombError` (twice its limit) stays. A filter installed once per process (idempotent),
    not around each open: warning filters are process-wide and `catch_warnings` is not thread-safe. Library
    callers' processes (`VisionEncoder`) keep their own filters: it is not called there."""
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def _exif_transpose(img: Image.Image) -> Image.Image:
    try:
        if img.getexif().get(_ORIENTATION, 1) == 1:
            return img  # upright: exif_transpose would only copy it
        return ImageOps.exif_transpose(img)
    except Exception:
        # Broken EXIF metadata should not make an otherwise good image unusable (viewers ignore it too).
        return img


def _check_mode(mode: str) -> None:
    if mode == "F":
        raise InvalidImageError(
            "image mode F (32-bit float) is not accepted: float pixels have no defined range (white may be 1.0, "
            "255 or 65535); convert the image to 8 bits (mode L or RGB) first"
        )


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit and 32-bit integer grayscale -> L (LA where a `transparency` value is set) by the module's rule:
    the high byte of a 16-bit value. Other modes are returned as they are; F is refused."""
    _check_mode(img.mode)
    if img.mode != "I" and img.mode not in _SIXTEEN_BIT_MODES:
        return img
    values = np.asarray(img)  # uint16 (big-endian for I;16B) or int32 for I
    if img.mode == "I" and values.size:
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > 65535:
            raise InvalidImageError(
                f"image mode I (32-bit integer) is accepted with 16-bit values (0..65535) only; this one holds "
                f"{low}..{high}: scale it to 16 or 8 bits first"
            )
    gray = Image.fromarray((values >> 8).astype(np.uint8))
    transparent = img.info.get("transparency")
    if isinstance(transparent, int):
        # compared at 16 bits: 257 values share each high byte, only the one named is transparent
        alpha = np.where(values == transparent, 0, 255).astype(np.uint8)
        return Image.merge("LA", (gray, Image.fromarray(alpha)))
    return gray


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB conversion with the same rule as transformers' convert_to_rgb for PIL images (8-bit modes)."""
    img = _to_8bit(img)
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return img if img.mode == "RGB" else img.convert("RGB")  # converting RGB would only copy it
    except (ValueError, OSError) as e:
        raise InvalidImageError(f"cannot convert image of mode {img.mode} to RGB: {reason(e)}") from e


def _from_array(arr: np.ndarray, cfg: DecodeLimits) -> Image.Image:
    if arr.dtype != np.uint8:
        raise InvalidImageError(f"image arrays must have dtype uint8, got {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
        raise InvalidImageError(f"image arrays must be HxW or HxWxC with C in 1/3/4, got shape {arr.shape}")
    check_image_size(arr.shape[1], arr.shape[0], cfg)
    # As an L / RGB / RGBA image, the PIL path gives the same bytes as transformers' array path (channel
    # repeat; float64 blend onto white, rounded), checked for every (value, alpha) pair in the tests.
    return _to_rgb(Image.fromarray(np.ascontiguousarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)))
