"""Does Inductor's max-autotune find faster one-image GEMMs than cuBLAS? (issue 15: Qwen2.5-VL-7B, 256 rows)

The one lever for the 1×224² latency that no session had measured is torch.compile: Inductor autotunes its
Triton GEMM templates (including the persistent TMA template for Hopper) against cuBLAS per shape, and can fuse
a pointwise epilogue or prologue into a Triton template. This compiles, with `mode="max-autotune-no-cudagraphs"`,
each of a block's four bias GEMMs at 256 rows and the MLP
(gate|up GEMM, SiLU·up, down GEMM), and times each against today's eager path in CUDA graphs (20 calls per
graph, µs per call, median of interleaved rounds); outputs are checked against today's path.

`python -m benchmarks.experiments.inductor_gemm [--rows 256] [--rounds 3]` (torch and triton only:
encoder/kernels/elementwise.py is loaded by path, for today's SiLU·up kernel)

Answer (H200, 2026-12-04): Inductor's max-autotune Triton templates are 5–23% slower than today's cuBLAS GEMMs
inside CUDA graphs at 256 rows, and its fused MLP is 17% slower (25.8 against 22.0 µs): nothing changed.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import per_call_us, trace_kernels

spec = importlib.util.spec_from_file_location(
    "encoder_kernels", Path(__file__).resolve().parents[2] / "encoder/kernels/elementwise.py"
)
K = importlib.util.module_from_spec(spec)
spec.loader.exec_module(K)

D, F_MLP = 1280, 3456  # Qwen2.5-VL-7B width and its MLP width as padded at load time
SHAPES = {"qkv": (D, 3 * D), "proj": (D, D), "gate_up": (D, 2 * F_MLP), "down": (F_MLP, D)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch._inductor.config as ic

    ic.max_autotune_gemm_backends = "ATEN,TRITON"
    ic.triton.enable_persistent_tma_matmul = True
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    w = {k: torch.randn(n, kk, device=dev, dtype=bf16) / kk**0.5 for k, (kk, n) in SHAPES.items()}
    b = {k: torch.randn(n, device=dev, dtype=bf16) * 0.1 for k, (_, n) in SHAPES.items()}
    xs = {k: torch.randn(args.rows, kk, device=dev, dtype=bf16) for k, (kk, _) in SHAPES.items()}

    def eager_linear(k):
        return lambda: F.linear(xs[k], w[k], b[k])

    def mlp(x):
        g, u = F.linear(x, w["gate_up"], b["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w["down"], b["down"])

    def eager_mlp():  # today's path: cuBLAS, the Triton SiLU·up kernel, cuBLAS
        return F.linear(K.silu_mul(F.linear(xs["gate_up"], w["gate_up"], b["gate_up"])), w["down"], b["down"])

    mode = "max-autotune-no-cudagraphs"
    cases = {k: (eager_linear(k), torch.compile(F.linear, mode=mode, dynamic=False)) for k in SHAPES}
    cases["mlp"] = (eager_mlp, torch.compile(mlp, mode=mode, dynamic=False))
    rows = []
    with torch.inference_mode():
        for name, (eager, compiled) in cases.items():
            run = (
                (lambda c=compiled, k=name: c(xs[k], w[k], b[k]))
                if name in SHAPES
                else (lambda c=compiled: c(xs["gate_up"]))
            )
            ref, got = eager().float(), run().float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            te, tc = [], []
            for _ in range(args.rounds):
                te.append(per_call_us(eager))
                tc.append(per_call_us(run))
            kernels = [e["name"][:60] for e in trace_kernels(run, f"/tmp/inductor_{name}.json")]
            rows.append((name, statistics.median(te), statistics.median(tc), err, kernels))
            print(f"{name}: eager {te} compiled {tc} err {err:.1e} kernels {kernels}", flush=True)
    print(f"\n| {args.rows} rows | today µs | max-autotune µs | today / compiled | max rel. diff | compiled kernels |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, te, tc, err, kernels in rows:
        print(f"| {name} | {te:.2f} | {tc:.2f} | {te / tc:.3f} | {err:.1e} | {'; '.join(f'`{k}`' for k in kernels)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
