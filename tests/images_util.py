"""Test image generators: seeded random content, encoders for each format, crafted hostile files."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_array(height: int, width: int, channels: int | None = 3, seed: int = 0) -> np.ndarray:
    """Random uint8 noise, HxW (channels=None) or HxWxC; noise is a harsh test for resampling."""
    shape = (height, width) if channels is None else (height, width, channels)
    return rng(seed).integers(0, 256, shape, dtype=np.uint8)


def random_image(mode: str, height: int, width: int, seed: int = 0) -> Image.Image:
    """A random PIL image of the given mode (RGB, L, P, RGBA, LA, CMYK, I;16, 1)."""
    if mode in ("RGB", "RGBA", "CMYK", "LA"):
        channels = {"RGB": 3, "RGBA": 4, "CMYK": 4, "LA": 2}[mode]
        data = random_array(height, width, channels, seed)
        return Image.frombytes(mode, (width, height), data.tobytes())
    if mode == "L":
        return Image.fromarray(random_array(height, width, None, seed))
    if mode == "P":
        return random_image("RGB", height, width, seed).quantize(64)
    if mode == "I;16":
        # The whole 16-bit range: `load_image` keeps the high byte, which carries the picture.
        return Image.fromarray(rng(seed).integers(0, 65536, (height, width), dtype=np.uint16))
    if mode == "1":
        return random_image("L", height, width, seed).convert("1")
    raise ValueError(mode)


def encode(img: Image.Image, fmt: str, **save_kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def jpeg_with_orientation(height: int, width: int, orientation: int, seed: int = 0) -> bytes:
    """JPEG whose stored pixels are HxW but whose EXIF says to display rotated/flipped."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(random_image("RGB", height, width, seed), "JPEG", quality=90, exif=exif.tobytes())


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_bomb_header(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width x height RGB; its pixel data is far too short to decode."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    chunks = _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def png_with_text(side: int, megabytes: int, before_pixels: bool = False) -> bytes:
    """A side x side RGB PNG carrying `megabytes` zTXt chunks that each decompress to 1,000,000 bytes (~1 KB
    each in the file): a memory bomb in text chunks. After the pixel data (IDAT) by default, where Pillow reads
    them during `load()`; before it, where `Image.open` does."""
    png = encode(random_image("RGB", side, side), "PNG")
    text = _png_chunk(b"zTXt", b"note\x00\x00" + zlib.compress(b"a" * 1_000_000, 9)) * megabytes
    if before_pixels:
        ihdr_end = 8 + 8 + 13 + 4  # signature, then IHDR: length and type, 13 bytes of fields, CRC
        return png[:ihdr_end] + text + png[ihdr_end:]
    return png[:-12] + text + png[-12:]  # before IEND (the last 12 bytes)


def two_bucket_images() -> list[tuple[bytes, np.ndarray]]:
    """A small (64x80: bucket 256) and a large (448x448: bucket 1024) PNG with their mean embeddings from the eager
    `tiny` encoder: with one image per encoder request the bucket router sends them to different replicas."""
    import encoder

    reference = encoder.load("tiny")
    out = []
    for h, w in ((64, 80), (448, 448)):
        data = encode(random_image("RGB", h, w, h), "PNG")
        out.append((data, reference.encode([data], pooling="mean")[0].numpy()))
    return out
