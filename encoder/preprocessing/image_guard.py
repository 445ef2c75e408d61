"""Structural limits on encoded image bytes, checked before Pillow decodes any pixel.

The pixel limit (`max_image_pixels`, read from the header) bounds memory, not time: a 512x512 progressive
JPEG with 24,000 near-empty refinement scans is 288 KB and takes libjpeg ~12 s (its cost is scans x
blocks). `check_structure` walks the container (JPEG marker segments, PNG / WebP chunks, GIF blocks, TIFF
directories) in linear time without decoding and refuses files whose scan, chunk, frame or tag counts are
beyond what real encoders write, with `ImageTooComplexError` naming the limit; structures that point past
the end of the data raise `ImageDecodeError`, except a cut from the image data on (inside a JPEG scan, a
PNG from its first IDAT), which is the decoder's call. Anything the walk does not understand is left to
the decoder, so no file Pillow decodes today is refused for its structure unless it is over a limit.

Defaults (`ImageLimits`): 100 JPEG scans (libjpeg's progressive script for a colour image writes 10;
libjpeg-turbo's djpeg/jpegtran offer `-maxscans` for this very attack), 4,096 JPEG marker segments,
65,536 PNG / WebP chunks, 262,144 GIF blocks, 1,024 TIFF tags per directory, 10,000 frames or pages.
Pillow handles chunks and segments in Python, ~3 us each: 65,536 empty IDAT chunks (0.8 MB) take its
decode 0.23 s, 100,000 empty JPEG comments (0.4 MB) its Image.open 0.3 s, so a 20 MiB file of them would
take seconds without these limits. Frames after the first are never decoded (`load_image` uses frame
0), so the frame limit only bounds the walk and what a later frame-aware caller would face.

Cost (`benchmarks/experiments/decode_limits.py` on a 2-core CPU box shared with other jobs, two runs at load
averages ~9 and ~2.5; best of 5): the JPEG walk is one C-level regex search per scan, ~0.5 ms per MB of
entropy-coded data; the other formats jump from header to header:
  224x224 JPEG q90, 10 KB: 15-23 us           4000x4000 JPEG q90 photo-like, 3.3 MB: 1.8-1.9 ms (decode 92 ms)
  4000x4000 progressive, 2.9 MB: 1.3-1.4 ms   4000x4000 JPEG of noise (worst case), 14.3 MB: 6.7-6.9 ms
  4000x4000 PNG, 34 MB: 0.25-0.5 ms           512x512 bomb of 2,002 scans: refused in 0.15-0.2 ms
The bomb this stops (`tests/jpeg_bombs.py`), decoded by Pillow on the same box: 512x512 with 1,002 scans
(13 KB) 0.34-0.49 s, with 5,002 scans (61 KB) 1.2-2.0 s. What the limit still lets through, 100 scans:
20-24 ms at 512x512 (grayscale), 85-110 ms at 1024x1024, 1.5-2.1 s at 4096x4096 (36 KB): cost is
scans x blocks, so large images still need a decode deadline (`deployments.ingress.decode_pool`).
"""

from __future__ import annotations

import re
import struct

from pydantic import BaseModel, ConfigDict, Field

from encoder.errors import ImageDecodeError, ImageTooComplexError


class ImageLimits(BaseModel):
    """Limits on the structure of encoded images (see the module docstring for the defaults' reasons)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_jpeg_scans: int = Field(100, gt=0, description="SOS segments (scans) in a JPEG.")
    max_jpeg_segments: int = Field(4096, gt=0, description="Marker segments with a length in a JPEG.")
    max_chunks: int = Field(65_536, gt=0, description="Chunks in a PNG or WebP file.")
    max_gif_blocks: int = Field(262_144, gt=0, description="Blocks and data sub-blocks in a GIF.")
    max_tiff_tags: int = Field(1024, gt=0, description="Entries in one TIFF image file directory.")
    max_frames: int = Field(10_000, gt=0, description="Frames (APNG, GIF, WebP) or pages (TIFF).")


DEFAULT_LIMITS = ImageLimits()


def check_structure(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> None:
    """Raise ImageTooComplexError / ImageDecodeError if the encoded image is over a structural limit or
    its structure runs past the data; formats without checks (BMP, unknown bytes) pass."""
    head = bytes(data[:4])
    if head[:3] == b"\xff\xd8\xff":
        _check_jpeg(data, limits)
    elif head == b"\x89PNG":
        _check_png(data, limits)
    elif head[:3] == b"GIF":
        _check_gif(data, limits)
    elif head == b"RIFF" and bytes(data[8:12]) == b"WEBP":
        _check_webp(data, limits)
    elif head in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        _check_tiff(data, limits)


def _too_complex(fmt: str, what: str, count: int, name: str, limit: int) -> ImageTooComplexError:
    return ImageTooComplexError(f"{fmt} image has {count} {what}, over the limit {name}={limit}")


def _past_end(fmt: str, what: str, pos: int, size: int) -> ImageDecodeError:
    return ImageDecodeError(
        f"{fmt} image is truncated or corrupt: {what} at byte {pos} runs past the end ({size} bytes)"
    )


# ----------------------------------------------------------------------------------------- JPEG

# In entropy-coded data a 0xFF byte is followed by 0x00 (stuffing) or a restart marker RST0-7 (0xD0-0xD7);
# any other byte after 0xFF starts the next marker. One C-level regex search skips a whole scan.
_MARKER_IN_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7]")
_NEXT_FF = re.compile(rb"\xff")
_FILL = re.compile(rb"\xff+")  # a marker may be preceded by any number of 0xFF fill bytes
# Markers without a length field: TEM, RST0-7, SOI, EOI.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})
_EOI, _SOS = 0xD9, 0xDA


def _check_jpeg(data: bytes, limits: ImageLimits) -> None:
    n, pos, scans, segments = len(data), 2, 0, 0
    while pos < n:
        if data[pos] != 0xFF:
            # Junk between segments: libjpeg and Pillow skip to the next 0xFF with a warning; so do we.
            m = _NEXT_FF.search(data, pos)
            if m is None:
                return
            pos = m.start()
        pos = _FILL.match(data, pos).end()
        if pos >= n:
            return
        marker = data[pos]
        pos += 1
        if marker == _EOI:
            return  # what follows (an MPO's further pictures, trailers) is not decoded as this picture
        if marker in _STANDALONE or marker == 0x00:
            continue
        if pos + 2 > n:
            raise _past_end("JPEG", f"the length of marker 0xFF{marker:02X}", pos - 2, n)
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2:
            raise ImageDecodeError(
                f"JPEG image is corrupt: marker 0xFF{marker:02X} at byte {pos - 2} has length {length}"
            )
        if pos + length > n:
            raise _past_end("JPEG", f"the 0xFF{marker:02X} segment ({length} bytes)", pos - 2, n)
        segments += 1
        if segments > limits.max_jpeg_segments:
            raise _too_complex("JPEG", "marker segments", segments, "max_jpeg_segments", limits.max_jpeg_segments)
        pos += length
        if marker == _SOS:
            scans += 1
            if scans > limits.max_jpeg_scans:
                raise _too_complex("JPEG", "scans", scans, "max_jpeg_scans", limits.max_jpeg_scans)
            m = _MARKER_IN_SCAN.search(data, pos)
            if m is None:
                return  # ends inside a scan (no EOI): truncation is the decoder's call
            pos = m.start()


# ----------------------------------------------------------------------------------------- PNG

_MAX_CHUNK = 2**31 - 1  # the PNG specification's bound on a chunk length


def _check_png(data: bytes, limits: ImageLimits) -> None:
    n, pos, chunks, seen_idat = len(data), 8, 0, False
    while pos < n:
        # a cut from the image data on (IEND's or the last IDAT's CRC, trailing metadata, or IDAT data that
        # falls short) is the decoder's call, as a JPEG cut inside a scan is: Pillow decodes such a PNG when
        # its pixels are all there and says "truncated" when they are not
        if pos + 8 > n:
            if seen_idat:
                return
            raise _past_end("PNG", "a chunk header", pos, n)
        length, kind = struct.unpack_from(">I4s", data, pos)
        name = kind.decode("latin-1")
        if length > _MAX_CHUNK:
            raise ImageDecodeError(
                f"PNG image is corrupt: chunk {name!r} at byte {pos} declares {length} bytes (> 2^31-1)"
            )
        if pos + 12 + length > n:
            if seen_idat or kind == b"IDAT":
                return
            raise _past_end("PNG", f"chunk {name!r} ({length} bytes)", pos, n)
        seen_idat = seen_idat or kind == b"IDAT"
        chunks += 1
        if chunks > limits.max_chunks:
            raise _too_complex("PNG", "chunks", chunks, "max_chunks", limits.max_chunks)
        if kind == b"acTL" and length >= 4:
            frames = struct.unpack_from(">I", data, pos + 8)[0]
            if frames > limits.max_frames:
                raise _too_complex("PNG", "animation frames", frames, "max_frames", limits.max_frames)
        if kind == b"IEND":
            return
        pos += 12 + length


# ----------------------------------------------------------------------------------------- GIF


def _skip_sub_blocks(data: bytes, pos: int, blocks: int, limits: ImageLimits) -> tuple[int, int]:
    """Skip a chain of data sub-blocks (a size byte, that many bytes; a 0 size ends it)."""
    n = len(data)
    while True:
        if pos >= n:
            raise _past_end("GIF", "a data sub-block", pos, n)
        size = data[pos]
        pos += 1 + size
        if size == 0:
            return pos, blocks
        blocks += 1
        if blocks > limits.max_gif_blocks:
            raise _too_complex("GIF", "blocks", blocks, "max_gif_blocks", limits.max_gif_blocks)


def _check_gif(data: bytes, limits: ImageLimits) -> None:
    n = len(data)
    if n < 13:
        raise _past_end("GIF", "the logical screen descriptor", 6, n)
    packed = data[10]
    pos = 13 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0)  # after the global colour table
    frames = blocks = 0
    while pos < n:
        kind = data[pos]
        if kind == 0x21:  # extension: label byte, then sub-blocks
            pos, blocks = _skip_sub_blocks(data, pos + 2, blocks, limits)
        elif kind == 0x2C:  # image: 9-byte descriptor, local colour table, LZW code size, sub-blocks
            frames += 1
            if frames > limits.max_frames:
                raise _too_complex("GIF", "frames", frames, "max_frames", limits.max_frames)
            if pos + 10 > n:
                raise _past_end("GIF", "an image descriptor", pos, n)
            packed = data[pos + 9]
            pos += 10 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0) + 1
            pos, blocks = _skip_sub_blocks(data, pos, blocks, limits)
        else:
            return  # the trailer (0x3B) or bytes the decoder will judge


# ----------------------------------------------------------------------------------------- WebP


def _check_webp(data: bytes, limits: ImageLimits) -> None:
    riff_end = min(len(data), 8 + struct.unpack_from("<I", data, 4)[0])
    pos, chunks, frames = 12, 0, 0
    while pos + 8 <= riff_end:
        kind, size = struct.unpack_from("<4sI", data, pos)
        if pos + 8 + size > riff_end:
            raise _past_end("WebP", f"chunk {kind.decode('latin-1')!r} ({size} bytes)", pos, riff_end)
        chunks += 1
        if chunks > limits.max_chunks:
            raise _too_complex("WebP", "chunks", chunks, "max_chunks", limits.max_chunks)
        if kind == b"ANMF":
            frames += 1
            if frames > limits.max_frames:
                raise _too_complex("WebP", "animation frames", frames, "max_frames", limits.max_frames)
        pos += 8 + size + (size & 1)  # chunks are padded to an even size


# ----------------------------------------------------------------------------------------- TIFF


def _check_tiff(data: bytes, limits: ImageLimits) -> None:
    n = len(data)
    order = "<" if data[:2] == b"II" else ">"
    big = data[2:4] in (b"+\x00", b"\x00+")
    # Classic TIFF: 2-byte entry count, 12-byte entries, 4-byte offsets; BigTIFF: 8, 20, 8.
    count_fmt, entry, off_fmt, first_at = ("Q", 20, "Q", 8) if big else ("H", 12, "I", 4)
    if first_at + struct.calcsize(off_fmt) > n:
        raise _past_end("TIFF", "the header", 0, n)
    offset = struct.unpack_from(order + off_fmt, data, first_at)[0]
    seen, pages = set(), 0
    while offset and offset not in seen:  # a directory loop ends the chain (Pillow stops there too)
        count_at = offset + struct.calcsize(count_fmt)
        if count_at > n:
            if pages == 0:
                raise _past_end("TIFF", "the first image file directory", offset, n)
            return  # a broken link to a later page: only the first page is decoded
        seen.add(offset)
        pages += 1
        if pages > limits.max_frames:
            raise _too_complex("TIFF", "pages", pages, "max_frames", limits.max_frames)
        count = struct.unpack_from(order + count_fmt, data, offset)[0]
        if count > limits.max_tiff_tags:
            raise _too_complex("TIFF", f"tags in directory {pages}", count, "max_tiff_tags", limits.max_tiff_tags)
        next_at = count_at + count * entry
        if next_at + struct.calcsize(off_fmt) > n:
            if pages == 1:
                raise _past_end("TIFF", f"the first image file directory ({count} entries)", offset, n)
            return
        offset = struct.unpack_from(order + off_fmt, data, next_at)[0]
