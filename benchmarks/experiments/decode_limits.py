"""Cost of the decode protections of issue 17 on this CPU: the structural guard, scan bombs, the pool.

    python -m benchmarks.experiments.decode_limits            # all sections
    python -m benchmarks.experiments.decode_limits --bomb-scans 1000 5000

Prints one line per measurement (median, or best of 5 for the microsecond-scale guard). The numbers in
the docstrings of encoder/preprocessing/image_guard.py and deployments/ingress/decode_pool.py come from this script.

Answer (2-core CPU box, issue 17): the structural guard costs 15–23 µs for a 224² JPEG and ≈ 0.5 ms per MB of
entropy-coded data (a 2,002-scan bomb is refused in 0.2 ms); the decode pool adds ≈ 0.3 ms per small image and ≈ 1
ms per MB of pixels returned. Both kept on every request (details in the docstrings of
`encoder/preprocessing/image_guard.py` and
`deployments/ingress/decode_pool.py`).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import timeit

import numpy as np
from PIL import Image

from deployments.ingress.decode_pool import DecodePool, decode_resized, decode_rgb
from encoder.errors import ImageTooComplexError
from encoder.preprocessing.image_guard import check_structure
from encoder.preprocessing.images import load_image
from encoder.preprocessing.qwen import DEFAULT_CONFIG
from tests.jpeg_bombs import scan_bomb


def encoded(pixels: np.ndarray, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def photo_like(side: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus mild noise: compresses like a photo (~0.2-0.3 bytes/pixel at quality 90)."""
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    base = np.stack([np.sin(6 * x + 2 * y), np.cos(5 * y - 3 * x), np.sin(4 * (x + y))], axis=-1) * 80 + 128
    noise = np.random.default_rng(seed).normal(0, 6, base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def noise(side: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def guard_cost() -> None:
    cases = {
        "224x224 JPEG q90 (photo-like)": encoded(photo_like(224), "JPEG", quality=90),
        "4000x4000 JPEG q90 (photo-like)": encoded(photo_like(4000), "JPEG", quality=90),
        "4000x4000 JPEG q90 progressive (photo-like)": encoded(photo_like(4000), "JPEG", quality=90, progressive=True),
        "4000x4000 JPEG q90 (noise: worst case)": encoded(noise(4000), "JPEG", quality=90),
        "4000x4000 PNG (photo-like)": encoded(photo_like(4000), "PNG", compress_level=1),
    }
    for name, data in cases.items():
        check_structure(data)
        best = min(timeit.repeat(lambda d=data: check_structure(d), number=3, repeat=5)) / 3
        print(f"guard  {name}: {len(data) / 1e6:.2f} MB, {best * 1e6:,.0f} us")
    data = cases["4000x4000 JPEG q90 (photo-like)"]
    took = min(timeit.repeat(lambda: load_image(data), number=1, repeat=3))
    print(f"decode 4000x4000 JPEG q90 (photo-like) with load_image, for scale: {took * 1e3:,.0f} ms")
    bomb = scan_bomb(2000)

    def refuse() -> None:
        try:
            check_structure(bomb)
        except ImageTooComplexError:
            pass

    best = min(timeit.repeat(refuse, number=3, repeat=5)) / 3
    print(f"guard  512x512 bomb, 2,002 scans ({len(bomb) / 1e3:.0f} KB): refused in {best * 1e6:,.0f} us")


def bomb_decode(scans: list[int]) -> None:
    # The first three are at the default limit (100 scans): what still reaches the decoder.
    for n, side in [(98, 512), (98, 1024), (98, 4096)] + [(n, 512) for n in scans]:
        data = scan_bomb(n, side, side)
        img = Image.open(io.BytesIO(data))
        started = time.perf_counter()
        img.load()
        took = time.perf_counter() - started
        print(f"bomb   {side}x{side}, {n + 2:,} scans ({len(data) / 1e3:.0f} KB): Pillow decodes in {took:.2f} s")


def pool_overhead(runs: int) -> None:
    for fn, inline_fn in ((decode_rgb, decode_rgb), (decode_resized, decode_resized)):
        with DecodePool(1, decode_fn=fn) as pool:
            for side in (224, 2048):
                data = encoded(photo_like(side), "JPEG", quality=90)
                inline, pooled = [], []
                for _ in range(runs):  # interleaved, so load from other jobs hits both alike
                    t = time.perf_counter()
                    shape = inline_fn(data, DEFAULT_CONFIG).shape
                    inline.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    pool.decode(data, 60.0)
                    pooled.append(time.perf_counter() - t)
                a, b = statistics.median(inline) * 1e3, statistics.median(pooled) * 1e3
                print(f"pool   {fn.__name__} {side}x{side} JPEG q90 -> {shape}: inline {a:.2f} ms, pool {b:.2f} ms")
    with DecodePool(1, decode_fn=_sleepy) as pool:
        small = encoded(photo_like(32), "JPEG")
        times = []
        for _ in range(5):
            try:
                pool.decode(b"sleep", 0.2)
            except Exception:  # noqa: BLE001 - DecodeTimeoutError, expected
                pass
            t = time.perf_counter()
            pool.decode(small, 60.0)  # one worker: waits for the replacement
            times.append(time.perf_counter() - t)
        took = statistics.median(times) * 1e3
        print(f"pool   replacement after a kill, until the next decode is answered: {took:.0f} ms")


def _sleepy(data: bytes, cfg):
    if data == b"sleep":
        time.sleep(60)
    return np.asarray(load_image(data, cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bomb-scans", type=int, nargs="*", default=[1000, 5000])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    guard_cost()
    bomb_decode(args.bomb_scans)
    pool_overhead(args.runs)


if __name__ == "__main__":
    main()
