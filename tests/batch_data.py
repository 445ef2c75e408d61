"""Test data for the batch job's tests (`tests/unit/deployments/batch/`, `tests/integration/batch/`): random images
of mixed sizes, modes and formats, corrupt ones, rows of both, the eager encoder's reference, and the CLI in this
process."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

import encoder
from deployments.batch.__main__ import main as cli_main

# float32 on CPU: the batch job encodes images in batches of its own make-up and thread count, the reference one
# by one, so BLAS sums in another order (seen up to 4e-5 of the largest value on a 2-core machine); a wrong row
# (another image, a lost row, bad preprocessing) differs by O(1).
REL_TOL = 1e-4


def random_picture(seed: int) -> Image.Image:
    """Mixed size (28..120 px sides), mixed mode, random content: a random gradient plus noise."""
    rng = np.random.default_rng(seed)
    h, w = (int(v) for v in rng.integers(28, 121, 2))
    yy, xx = np.mgrid[0:h, 0:w]
    base = rng.uniform(0, 255, 3)[None, None] + rng.uniform(-2, 2, 3)[None, None] * (xx + yy)[..., None]
    pixels = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels)
    mode = ["RGB", "RGB", "L", "RGBA"][seed % 4]
    return img if mode == "RGB" else img.convert(mode)


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def good_image(seed: int) -> bytes:
    img = random_picture(seed)
    fmt = ["PNG", "JPEG", "WEBP"][seed % 3]
    if fmt == "JPEG" and img.mode == "RGBA":
        fmt = "PNG"
    return encoded(img, fmt)


def corrupt_images() -> list[bytes | None]:
    png = good_image(1)
    return [
        png[:60],  # truncated
        b"\x89PNG\r\n\x1a\n" + bytes(range(200)),  # header then garbage
        b"",  # empty
        None,  # null
        b"definitely not an image",
        encoded(Image.fromarray(np.full((2, 500, 3), 7, np.uint8)), "PNG"),  # aspect ratio 250:1
        encoded(random_picture(3).convert("RGB"), "PPM"),  # a format that is not allowed
    ]


def make_rows(n_good: int, seed: int, corrupt_every: int = 0) -> tuple[list[int], list, set[int]]:
    """ids, image bytes, and the ids of the corrupt rows (spread through the data)."""
    ids, images, bad = [], [], set()
    corrupt = corrupt_images() if corrupt_every else []
    total = n_good + len(corrupt)
    for row in range(total):
        ids.append(seed * 100_000 + row)
        if corrupt and row % corrupt_every == corrupt_every - 1 and len(bad) < len(corrupt):
            images.append(corrupt[len(bad)])
            bad.add(ids[-1])
        else:
            images.append(good_image(seed * 100_000 + row))
    assert len(bad) == len(corrupt), "raise n_good so every corrupt kind fits"
    return ids, images, bad


def reference(images: list[bytes], pooling: str) -> list[torch.Tensor]:
    """The eager `VisionEncoder.encode` on the same bytes (the batch job must match it)."""
    return encoder.load("tiny").encode(images, pooling=pooling)


def assert_close(got: np.ndarray, want: torch.Tensor) -> None:
    want = want.numpy()
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1e-6)
    assert float(np.abs(got - want).max()) <= REL_TOL * scale


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    assert parts, f"no parts in {out}"
    return pa.concat_tables([pq.read_table(p) for p in parts])


def cli(*args: str) -> int:
    return cli_main([*map(str, args), "--no-progress"])
