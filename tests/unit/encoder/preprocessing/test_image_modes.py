"""encoder.preprocessing.images: images wider than 8 bits (issue 44 case 7) and Pillow's process hardening against
PNG text-chunk bombs (case 8).

Broken before: PIL's `convert("RGB")` saturates I;16 / I / F values at 255, so different 16-bit pictures became
the same white image and embedded identically; a 16-bit gray PNG with a tRNS value came out all white.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile, PngImagePlugin

from encoder.errors import ImageTooComplexError, InvalidImageError
from encoder.preprocessing.images import PNG_TEXT_MEMORY, harden_pillow, load_image
from tests.images_util import _png_chunk, encode, png_with_text, rng

# 16-bit values and their 8-bit result under the rule (the high byte, value >> 8)
WIDE = [0, 255, 256, 0x80FF, 0xFEFF, 0xFF00, 0xFFFF]
EIGHT = [0, 0, 1, 128, 254, 255, 255]


def _png(width: int, height: int, color_type: int, rows: list[bytes], extra: bytes = b"") -> bytes:
    """A 16-bit PNG from raw big-endian rows (filter 0); `extra` chunks go before the pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    idat = zlib.compress(b"".join(b"\x00" + row for row in rows))
    chunks = _png_chunk(b"IHDR", ihdr) + extra + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def _gray16(mode: str) -> Image.Image:
    dtype = ">u2" if mode == "I;16B" else "<u2"
    return Image.frombytes(mode, (len(WIDE), 1), np.array(WIDE, dtype=dtype).tobytes())


def _rgb_row(img: Image.Image) -> list[int]:
    rgb = np.asarray(img)
    assert img.mode == "RGB" and (rgb == rgb[..., :1]).all()  # gray on all three channels
    return rgb[0, :, 0].tolist()


@pytest.mark.parametrize("mode", ["I;16", "I;16L", "I;16B", "I;16N"])
def test_16_bit_pil_images_keep_the_high_byte(mode):
    assert _rgb_row(load_image(_gray16(mode))) == EIGHT


@pytest.mark.parametrize(
    "data",
    [
        _png(len(WIDE), 1, 0, [struct.pack(f">{len(WIDE)}H", *WIDE)]),
        encode(_gray16("I;16"), "TIFF"),
        encode(_gray16("I;16B"), "TIFF"),
    ],
    ids=["png", "tiff-little-endian", "tiff-big-endian"],
)
def test_16_bit_files_keep_the_high_byte(data):
    assert Image.open(io.BytesIO(data)).mode.startswith("I;16")
    assert _rgb_row(load_image(data)) == EIGHT


def test_a_16_bit_gray_png_equals_the_same_picture_as_16_bit_rgb():
    """Pillow opens 16-bit RGB PNGs as 8-bit RGB by keeping the high byte; gray ones now agree with it."""
    gray = _png(len(WIDE), 1, 0, [struct.pack(f">{len(WIDE)}H", *WIDE)])
    rgb = _png(len(WIDE), 1, 2, [struct.pack(f">{3 * len(WIDE)}H", *[v for v in WIDE for _ in range(3)])])
    assert Image.open(io.BytesIO(rgb)).mode == "RGB"
    np.testing.assert_array_equal(np.asarray(load_image(gray)), np.asarray(load_image(rgb)))


def test_a_16_bit_transparent_value_is_matched_at_16_bits():
    """tRNS names one 16-bit value: that pixel goes white, 0x8000 (same high byte) stays 128. Broken: every
    pixel came out white (PIL's I;16 -> RGBA conversion)."""
    data = _png(3, 1, 0, [struct.pack(">3H", 0x80FF, 0x8000, 0x1234)], _png_chunk(b"tRNS", struct.pack(">H", 0x80FF)))
    assert Image.open(io.BytesIO(data)).info["transparency"] == 0x80FF
    assert _rgb_row(load_image(data)) == [255, 128, 0x12]


def test_different_16_bit_pictures_embed_differently():
    """The issue's symptom: 200 with the same vector for different 16-bit pictures (all white)."""
    import encoder

    # every value above 255, as in most 16-bit pictures: PIL's conversion made both all white
    first, second = (
        encode(Image.fromarray(rng(s).integers(256, 65536, (64, 64), dtype=np.uint16)), "PNG") for s in (1, 2)
    )
    pixels = [np.asarray(load_image(x)) for x in (first, second)]
    assert all(0 < p.mean() < 255 for p in pixels) and not np.array_equal(*pixels)
    vectors = encoder.load("tiny", device="cpu").encode([first, second], pooling="mean")
    assert (vectors[0] - vectors[1]).abs().max() > 1e-3


def test_mode_i_within_16_bits_follows_the_16_bit_rule():
    img = Image.fromarray(np.array([WIDE], dtype=np.int32))
    assert img.mode == "I"
    assert _rgb_row(load_image(img)) == EIGHT
    assert _rgb_row(load_image(encode(img, "TIFF"))) == EIGHT  # a 32-bit integer TIFF


@pytest.mark.parametrize(("values", "held"), [([0, 70_000], "0..70000"), ([-5, 100], "-5..100")])
def test_mode_i_outside_16_bits_is_refused(values, held):
    img = Image.fromarray(np.array([values], dtype=np.int32))
    for x in (img, encode(img, "TIFF")):
        with pytest.raises(InvalidImageError, match=f"image mode I \\(32-bit integer\\).*holds {held}"):
            load_image(x)


def test_mode_f_is_refused_before_decoding(monkeypatch):
    img = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    data = encode(img, "TIFF")
    with pytest.raises(InvalidImageError, match="image mode F \\(32-bit float\\) is not accepted"):
        load_image(img)

    def no_decode(self):
        raise AssertionError("decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)  # the header names the mode
    for x in (data, Image.open(io.BytesIO(data))):
        with pytest.raises(InvalidImageError, match="image mode F"):
            load_image(x)


def test_arrays_stay_uint8_only():
    with pytest.raises(InvalidImageError, match="dtype uint8, got uint16"):
        load_image(np.array([WIDE], dtype=np.uint16))


# ------------------------------------------------------------------------------------------ harden_pillow


@pytest.fixture
def hardened(monkeypatch):
    """`harden_pillow` in this process, its process-wide settings restored afterwards."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", PngImagePlugin.MAX_TEXT_MEMORY)
    with warnings.catch_warnings():  # restores the filter it adds
        harden_pillow(50_000_000)
        yield


@pytest.mark.parametrize("before_pixels", [False, True], ids=["after-idat", "before-idat"])
def test_text_chunk_bombs_are_refused_as_too_complex(hardened, before_pixels):
    """60 MB of zTXt in a 512x512 PNG: under Pillow's default 64 MiB, over ours. Refused with a message that
    says what (not "truncated or corrupt"), read in Image.open or in load() depending on where the chunks are."""
    assert PngImagePlugin.MAX_TEXT_MEMORY == PNG_TEXT_MEMORY and Image.MAX_IMAGE_PIXELS == 50_000_000
    with pytest.raises(ImageTooComplexError, match="PNG text chunks .* more than the limit of 8388608 bytes"):
        load_image(png_with_text(512, 60, before_pixels))
    assert load_image(png_with_text(64, 7, before_pixels)).size == (64, 64)  # 7 MB of text: under it


def test_harden_pillow_never_raises_a_lower_text_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1234)
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", 2**20)
    with warnings.catch_warnings():
        harden_pillow()  # no pixel limit given: Pillow's threshold left as it is
    assert PngImagePlugin.MAX_TEXT_MEMORY == 2**20 and Image.MAX_IMAGE_PIXELS == 1234
