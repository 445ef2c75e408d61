"""The four GEMMs of a Qwen2.5-VL-7B block (bias, bf16) at few rows, 20 calls per CUDA graph, µs per call.

Run under different cuBLAS environments (`CUBLASLT_WORKSPACE_SIZE`, `DISABLE_ADDMM_CUDA_LT`) to see whether
the library picks other kernels: `python -m benchmarks.experiments.block_gemms --rows 256,1024`.

Answer (H200, 2026-12-01): at 256 rows qkv 6.3, proj 5.1, gate_up 9.5, down 8.8 µs (29.7 per block);
`CUBLASLT_WORKSPACE_SIZE=65536` picks other kernels for no gain, `DISABLE_ADDMM_CUDA_LT=1` is slower (42.5): no
cuBLAS environment knob shortens the one-image GEMMs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import per_call_us

SHAPES = {"qkv": (1280, 3840), "proj": (1280, 1280), "gate_up": (1280, 6912), "down": (3456, 1280)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="256,1024")
    p.add_argument("--layers", type=int, default=8, help="distinct layers for the cold-weights sequence")
    args = p.parse_args()
    env = {k: os.environ[k] for k in ("CUBLASLT_WORKSPACE_SIZE", "DISABLE_ADDMM_CUDA_LT") if k in os.environ}
    for rows in map(int, args.rows.split(",")):
        cells = []
        for name, (k, n) in SHAPES.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            cells.append(f"{name} {per_call_us(lambda x=x, w=w, b=bias: F.linear(x, w, b)):.1f}")
        total = sum(float(c.split()[1]) for c in cells)
        print(f"rows {rows} env {env or 'default'}: " + ", ".join(cells) + f"; sum {total:.1f} µs", flush=True)
        sequence(rows, args.layers)
    return 0


def sequence(rows: int, layers: int) -> None:
    """A block's four GEMMs in order over `layers` distinct weight sets (more bytes than L2 holds, as in the
    tower) vs the same set `layers` times (weights L2-hot): µs per block, one graph each."""
    sets = []
    for _ in range(layers):
        sets.append([(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5,
                      torch.randn(n, device="cuda", dtype=torch.bfloat16)) for k, n in SHAPES.values()])  # fmt: skip
    xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k, _ in SHAPES.values()}

    def run(chosen):
        for layer in chosen:
            for (k, _), (w, b) in zip(SHAPES.values(), layer, strict=True):
                F.linear(xs[k], w, b)

    cold = per_call_us(lambda: run(sets), calls=1) / layers
    hot = per_call_us(lambda: run([sets[0]] * layers), calls=1) / layers
    print(
        f"rows {rows}: a block's 4 GEMMs in sequence, {layers} distinct layers {cold:.1f} µs/block, "
        f"one layer repeated {hot:.1f} µs/block",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
