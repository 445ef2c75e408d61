"""Encode images from the command line: `python -m encoder IMAGE [IMAGE ...]`.

Prints one JSON line per image with its patch grid and (mean-pooled) embedding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import EncoderError, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m encoder", description=__doc__)
    parser.add_argument("images", nargs="+", type=Path, help="image files (PNG, JPEG, WebP, GIF, BMP, TIFF)")
    parser.add_argument("--model", default="tiny", help="preset name or local Hugging Face checkpoint dir")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--attention", default=None, help="attention backend (default: sdpa)")
    parser.add_argument("--pooling", default="mean", choices=["mean", "none"])
    args = parser.parse_args(argv)
    try:
        enc = load(args.model, device=args.device, dtype=args.dtype, attention=args.attention)
        data = [p.read_bytes() for p in args.images]
        batch = enc.preprocess(data)
        start = time.perf_counter()
        outs = enc.encode(batch, pooling=args.pooling)
        elapsed = time.perf_counter() - start
    except (EncoderError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path, grid, out in zip(args.images, batch.grid_thw.tolist(), outs, strict=True):
        print(json.dumps({"image": str(path), "grid_thw": grid, "shape": list(out.shape),
                          "embedding": [round(v, 6) for v in out.flatten()[:8].tolist()]}))  # fmt: skip
    print(f"{len(outs)} images, {enc.name} on {enc.device} ({enc.dtype}), {elapsed * 1e3:.1f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
