"""Does the weight layout change cuBLAS's speed for the towers' bias GEMMs? (issue 15: single-image latency)

`nn.Linear` keeps W as [N, K] and computes `x @ W.T + b` (cuBLAS sees a transposed operand); a load-time
transpose to a contiguous [K, N] makes it `x @ Wt + b` (no transpose), for which cuBLAS's heuristics may pick
other kernels. Both run as `torch.addmm(b, x, ...)` (the bias in cuBLASLt's epilogue), 20 calls per CUDA graph,
bf16, for Qwen2.5-VL-7B's four block GEMMs at the row counts of 1x224² (256), 1x448² (1024) and 8x896²
(25,088). Prints one table: µs per call for each layout, and the ratio.

    python -m benchmarks.experiments.gemm_layout [--rows 256,1024,25088] [--reps 30]

Answer (H200, 2026-12-01): the layout does not matter at 256 and 25,088 rows (0.999×, 1.000×) and the transposed [K,
N] weights are 4.6% slower at 1,024 rows: weights stay as `nn.Linear` stores them.
"""

from __future__ import annotations

import argparse

import torch

# the block's four GEMM shapes and the per-call time of 20 calls in one CUDA graph, as block_gemms measures them
from benchmarks.experiments.block_gemms import SHAPES, per_call_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,1024,25088")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| rows | GEMM | W [N,K] (x @ W.T) µs | Wt [K,N] (x @ Wt) µs | Wt / W |")
    print("| ---: | --- | ---: | ---: | ---: |")
    totals: dict[int, list[float]] = {}
    for m in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
            wt = w.t().contiguous()
            b = torch.randn(n, device=dev, dtype=dt)
            out_a, out_b = torch.empty(m, n, device=dev, dtype=dt), torch.empty(m, n, device=dev, dtype=dt)
            ref = torch.addmm(b, x, w.t())
            assert torch.allclose(torch.addmm(b, x, wt), ref, rtol=2e-2, atol=2e-2)  # same product
            a_us = per_call_us(lambda x=x, w=w, b=b, o=out_a: torch.addmm(b, x, w.t(), out=o), reps=args.reps)
            b_us = per_call_us(lambda x=x, wt=wt, b=b, o=out_b: torch.addmm(b, x, wt, out=o), reps=args.reps)
            totals.setdefault(m, [0.0, 0.0])
            totals[m][0] += a_us
            totals[m][1] += b_us
            print(f"| {m} | {name} | {a_us:.2f} | {b_us:.2f} | {b_us / a_us:.3f} |")
        t = totals[m]
        print(f"| {m} | **block (4 GEMMs)** | **{t[0]:.2f}** | **{t[1]:.2f}** | **{t[1] / t[0]:.3f}** |")


if __name__ == "__main__":
    main()
