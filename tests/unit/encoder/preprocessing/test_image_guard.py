"""encoder.preprocessing.image_guard: structural limits before decoding (issue 17, case 1),
and its hook in load_image."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from encoder.errors import EncoderError, ImageDecodeError, ImageTooComplexError
from encoder.preprocessing.image_guard import ImageLimits, check_structure
from encoder.preprocessing.images import load_image
from encoder.preprocessing.qwen import PreprocessConfig
from encoder.preprocessing.vit import VitPreprocessConfig
from tests.images_util import encode, random_image
from tests.jpeg_bombs import scan_bomb


def frames(fmt: str, n: int, **kwargs) -> bytes:
    images = [random_image("RGB", 24, 32, seed=i) for i in range(n)]
    buf = io.BytesIO()
    images[0].save(buf, format=fmt, save_all=True, append_images=images[1:], **kwargs)
    return buf.getvalue()


NORMAL = {
    "jpeg": lambda: encode(random_image("RGB", 64, 80), "JPEG", quality=90),
    "jpeg-progressive": lambda: encode(random_image("RGB", 64, 80), "JPEG", quality=95, progressive=True),
    "jpeg-gray-progressive": lambda: encode(random_image("L", 64, 80), "JPEG", progressive=True),
    "jpeg-restarts": lambda: encode(random_image("RGB", 64, 80), "JPEG", quality=95, restart_marker_blocks=2),
    "jpeg-exif": lambda: encode(random_image("RGB", 40, 40), "JPEG", exif=Image.Exif().tobytes()),
    "mpo": lambda: frames("MPO", 3),  # phone cameras: JPEG pictures one after another
    "png": lambda: encode(random_image("RGBA", 40, 50), "PNG"),
    "apng": lambda: frames("PNG", 3),
    "gif": lambda: encode(random_image("P", 40, 50), "GIF"),
    "gif-animated": lambda: frames("GIF", 3, loop=0),
    "webp": lambda: encode(random_image("RGB", 40, 50), "WEBP"),
    "webp-animated": lambda: frames("WEBP", 3),
    "tiff-pages": lambda: frames("TIFF", 3),
    "bmp": lambda: encode(random_image("RGB", 40, 50), "BMP"),
}


def test_scan_bomb_decodes_when_small_and_is_refused_when_large():
    small = scan_bomb(20)
    check_structure(small)  # 22 scans: within the limit
    pixels = np.asarray(load_image(small))
    assert pixels.shape == (512, 512, 3) and (pixels == 128).all()  # all-zero coefficients: mid grey
    bomb = scan_bomb(2000)
    started = time.perf_counter()
    with pytest.raises(ImageTooComplexError, match=r"2000|101 scans, over the limit max_jpeg_scans=100"):
        load_image(bomb)
    assert time.perf_counter() - started < 1.0  # decoding it would take seconds


def test_large_bomb_is_refused_before_open(monkeypatch):
    def no_open(*args, **kwargs):
        raise AssertionError("Image.open must not be reached")

    monkeypatch.setattr(Image, "open", no_open)
    with pytest.raises(ImageTooComplexError, match="max_jpeg_scans"):
        load_image(scan_bomb(150, 4096, 4096))


def test_limits_are_configurable():
    bomb = scan_bomb(20)
    strict = PreprocessConfig(image_limits=ImageLimits(max_jpeg_scans=10))
    with pytest.raises(ImageTooComplexError, match="22 scans|11 scans"):
        load_image(bomb, strict)
    vit = VitPreprocessConfig(height=32, width=32, image_limits=ImageLimits(max_jpeg_scans=10))
    with pytest.raises(ImageTooComplexError, match="max_jpeg_scans=10"):
        load_image(bomb, vit)
    assert PreprocessConfig.model_validate(strict.model_dump()) == strict  # survives the replica's dump


@pytest.mark.parametrize("kind", sorted(NORMAL))
def test_normal_images_pass_and_decode(kind):
    data = NORMAL[kind]()
    check_structure(data)
    assert load_image(data).mode == "RGB"


def test_scans_are_counted_through_stuffing_and_restarts():
    # libjpeg's progressive script writes 10 scans for a colour image; noise at quality 95 has many
    # stuffed 0xFF00 bytes and the restart variant has RSTn markers inside every scan.
    plain = encode(random_image("RGB", 96, 96), "JPEG", quality=95, progressive=True)
    restarts = encode(random_image("RGB", 96, 96), "JPEG", quality=95, progressive=True, restart_marker_blocks=1)
    assert b"\xff\xd0" in restarts and b"\xff\xd7" in restarts
    for data in (plain, restarts):
        assert data.count(b"\xff\x00") > 10
        check_structure(data, ImageLimits(max_jpeg_scans=10))
        with pytest.raises(ImageTooComplexError, match="10 scans, over the limit max_jpeg_scans=9"):
            check_structure(data, ImageLimits(max_jpeg_scans=9))


def test_fill_bytes_and_junk_between_segments_are_tolerated():
    data = encode(random_image("RGB", 32, 32), "JPEG")
    assert data.endswith(b"\xff\xd9")
    filled = data[:-2] + b"\xff\xff\xff\xd9"
    check_structure(filled, ImageLimits(max_jpeg_scans=1))
    assert load_image(filled).size == (32, 32)


def test_too_many_segments():
    base = scan_bomb(0)
    data = base[:2] + b"\xff\xfe\x00\x02" * 5000 + base[2:]  # 5000 empty comments
    with pytest.raises(ImageTooComplexError, match="4097 marker segments, over the limit max_jpeg_segments=4096"):
        check_structure(data)


FRAMES = [("apng", "animation frames"), ("gif-animated", "frames"), ("webp-animated", "animation frames"),
          ("tiff-pages", "pages")]  # fmt: skip


@pytest.mark.parametrize(("kind", "what"), FRAMES)
def test_frame_limits(kind, what):
    data = NORMAL[kind]()
    check_structure(data, ImageLimits(max_frames=3))
    with pytest.raises(ImageTooComplexError, match=f"{what}, over the limit max_frames=2"):
        check_structure(data, ImageLimits(max_frames=2))


def test_chunk_limits():
    png = NORMAL["png"]()
    with pytest.raises(ImageTooComplexError, match="PNG image has 3 chunks, over the limit max_chunks=2"):
        check_structure(png, ImageLimits(max_chunks=2))
    with pytest.raises(ImageTooComplexError, match="GIF image has .* blocks, over the limit max_gif_blocks=1"):
        check_structure(NORMAL["gif"](), ImageLimits(max_gif_blocks=1))
    with pytest.raises(ImageTooComplexError, match="max_tiff_tags=2"):
        check_structure(NORMAL["tiff-pages"](), ImageLimits(max_tiff_tags=2))


def test_tiff_tags_exactly_at_the_limit_pass():
    data = NORMAL["tiff-pages"]()
    assert data[:4] == b"II*\x00"
    offset, most = struct.unpack_from("<I", data, 4)[0], 0
    while offset:  # the largest directory of the chain
        count = struct.unpack_from("<H", data, offset)[0]
        most = max(most, count)
        offset = struct.unpack_from("<I", data, offset + 2 + 12 * count)[0]
    check_structure(data, ImageLimits(max_tiff_tags=most))
    with pytest.raises(ImageTooComplexError, match=f"has {most} tags in directory .*max_tiff_tags={most - 1}"):
        check_structure(data, ImageLimits(max_tiff_tags=most - 1))


def png_chunk(kind: bytes, payload: bytes, length: int | None = None) -> bytes:
    size = len(payload) if length is None else length
    return struct.pack(">I", size) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def test_malformed_structures_get_clear_errors():
    jpeg = encode(random_image("RGB", 32, 32), "JPEG")
    png = NORMAL["png"]()
    sig_ihdr = png[:33]
    cases = {
        "JPEG .*0xFFDB segment .* runs past the end": jpeg[:30],
        "JPEG image is corrupt: marker 0xFFDB at byte 2 has length 1": b"\xff\xd8\xff\xdb\x00\x01" + jpeg[6:],
        "JPEG .*the length of marker 0xFFDB .* runs past the end": b"\xff\xd8\xff\xdb\x00",
        "PNG .*chunk 'PLTE' \\(768 bytes\\) at byte 33 runs past the end": sig_ihdr + png_chunk(b"PLTE", b"x", 768),
        "PNG image is corrupt: chunk 'IDAT' at byte 33 declares 4294967295 bytes": sig_ihdr
        + png_chunk(b"IDAT", b"", 2**32 - 1),
        "PNG .*a chunk header at byte 33 runs past the end": sig_ihdr + b"\x00\x00",
        "GIF .*the logical screen descriptor": b"GIF89a\x01\x00",
        "GIF .*a data sub-block": NORMAL["gif"]()[:-30],
        "TIFF .*the first image file directory": b"II*\x00\xff\xff\x00\x00",
        "WebP .*chunk 'VP8 ' \\(5000 bytes\\)": b"RIFF\x20\x00\x00\x00WEBPVP8 \x88\x13\x00\x00" + b"\x00" * 16,
    }
    for pattern, data in cases.items():
        with pytest.raises(ImageDecodeError, match=pattern) as info:
            check_structure(data)
        assert "object at" not in str(info.value) and "\n" not in str(info.value)
        with pytest.raises(ImageDecodeError):
            load_image(data)


def test_a_png_cut_after_its_pixels_decodes_as_pillow_decodes_it():
    """What Pillow decodes is not refused for its structure: a PNG whose IEND, or the last IDAT's CRC, was cut
    off (its pixels all there); one cut inside its image data is still an ImageDecodeError (Pillow's)."""
    image = random_image("RGB", 120, 150, seed=3)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    png = buf.getvalue()
    for cut in (4, 8, 12, 13, 16):  # IEND's CRC, its length field only, all of IEND, then the last IDAT's CRC
        data = png[:-cut]
        Image.open(io.BytesIO(data)).load()  # the premise: Pillow decodes it
        check_structure(data)
        assert np.array_equal(np.asarray(load_image(data)), np.asarray(image)), cut
    with pytest.raises(ImageDecodeError, match="PNG image is truncated or corrupt"):
        load_image(png[: len(png) // 2])


@pytest.mark.parametrize("kind", ["jpeg-progressive", "jpeg-restarts", "png", "apng", "gif-animated", "webp-animated",
                                  "tiff-pages"])  # fmt: skip
def test_truncations_and_corruptions_never_crash(kind):
    """Every prefix and seeded random byte changes: either accepted or an EncoderError, never another error."""
    data = NORMAL[kind]()
    rng = np.random.default_rng(0)
    variants = [data[:i] for i in range(0, len(data), max(1, len(data) // 400))]
    for _ in range(300):
        changed = bytearray(data)
        for at in rng.integers(0, len(data), 3):
            changed[at] = int(rng.integers(0, 256))
        variants.append(bytes(changed))
    for v in variants:
        try:
            check_structure(v)
        except EncoderError as e:
            assert "object at" not in str(e)


def test_bytes_like_inputs():
    data = scan_bomb(200)
    for v in (bytearray(data), memoryview(data)):
        with pytest.raises(ImageTooComplexError):
            check_structure(v)


def tiff(order: str, big: bool, ifds: int, loop: bool = False) -> bytes:
    """Empty directories chained one after another; the last points back to the first when `loop`."""
    e = "<" if order == "II" else ">"
    head_fmt, count_fmt, off_fmt = ("HHQ", "Q", "Q") if big else ("I", "H", "I")
    magic = struct.pack(e + "H", 43 if big else 42)
    first = 16 if big else 8
    head = order.encode() + magic + (struct.pack(e + head_fmt, 8, 0, first) if big else struct.pack(e + "I", first))
    size = struct.calcsize(count_fmt) + struct.calcsize(off_fmt)
    body = b""
    for i in range(ifds):
        nxt = first + (i + 1) * size if i + 1 < ifds else (first if loop else 0)
        body += struct.pack(e + count_fmt, 0) + struct.pack(e + off_fmt, nxt)
    return head + body


@pytest.mark.parametrize(("order", "big"), [("II", False), ("MM", False), ("II", True), ("MM", True)])
def test_tiff_directory_chains(order, big):
    check_structure(tiff(order, big, 3), ImageLimits(max_frames=3))
    with pytest.raises(ImageTooComplexError, match="TIFF image has 3 pages, over the limit max_frames=2"):
        check_structure(tiff(order, big, 3), ImageLimits(max_frames=2))
    check_structure(tiff(order, big, 3, loop=True), ImageLimits(max_frames=3))  # a loop ends the walk
