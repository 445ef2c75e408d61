"""Split-K through cuBLAS's batched GEMM for few-row GEMMs (issue 15: single-image latency).

At 256 rows cuBLAS runs Qwen2.5-VL-7B's block GEMMs on few CTAs with short K loops: they are not waiting for
HBM (`benchmarks/l2_prefetch.py`). Split-K gives a GEMM s times more CTAs. cuBLAS's heuristics do not pick it,
but a batched GEMM does it by construction: x [M, K] as s slices [s, M, K/s] against the weight's matching K
slices [s, K/s, N] (a load-time layout) gives s partial products [s, M, N]. Their sum plus the bias is the
answer. The sum could be folded into the kernel that reads the GEMM's output anyway (add+norm, rotary,
SiLU·up); here it is timed alone.

Per shape and split s, 20 calls per CUDA graph, µs per call:
* `addmm`: today's call (`F.linear`'s `addmm`, the bias in cuBLASLt's epilogue, bf16 out);
* `bmm s`: the batched GEMM alone, float32 partials (`out_dtype`), and bf16 partials;
* `bmm s + sum`: with the reduction (sum over s, bias, bf16) as a separate torch op.
Also checks each split's answer against float32.

    python -m benchmarks.experiments.bmm_split_k [--rows 256] [--splits 2,3,4,5]

Answer (H200, 2026-12-02): split-K helps only the N = 1280 GEMMs (proj 1.20×, down 1.40× with float32 partials), and
with the reduction folded into add+norm the tower gained ≈ 30 µs (1.7%) a 1×224² replay, within process-to-process
noise: built, measured and reverted.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.experiments.block_gemms import SHAPES, per_call_us


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--splits", default="2,3,4,5")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = args.rows
    print(f"rows {m}, bf16, µs per call (20 per CUDA graph); err = max |out - float32| / max |float32|")
    print(f"{'shape':<8} {'variant':<22} {'us':>7} {'vs addmm':>9} {'err':>9}")
    for name, (k, n) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = x.float() @ w.float().T + b.float()
        scale = want.abs().max().item()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        def addmm(x=x, w=w, b=b, out=out):  # F.linear's kernel (bias in cuBLASLt's epilogue), into `out`
            torch.addmm(b, x, w.t(), out=out)

        base = per_call_us(addmm)
        err = (out.float() - want).abs().max().item() / scale
        print(f"{name:<8} {'addmm':<22} {base:7.2f} {1:9.3f} {err:9.2e}")
        for s in [int(v) for v in args.splits.split(",")]:
            if k % s or (k // s) % 8:
                continue
            # load-time layout: [s, K/s, N] contiguous per slice (the weight's K slices, transposed)
            ws = w.view(n, s, k // s).permute(1, 2, 0).contiguous()
            xs = x.view(m, s, k // s).transpose(0, 1)  # [s, M, K/s] strided view, no copy
            part32 = torch.empty(s, m, n, device="cuda", dtype=torch.float32)
            part16 = torch.empty(s, m, n, device="cuda", dtype=torch.bfloat16)

            def bmm32(xs=xs, ws=ws, part32=part32):
                torch.bmm(xs, ws, out_dtype=torch.float32, out=part32)

            def bmm16(xs=xs, ws=ws, part16=part16):
                torch.bmm(xs, ws, out=part16)

            def bmm32_sum(xs=xs, ws=ws, part32=part32, b=b, out=out):
                torch.bmm(xs, ws, out_dtype=torch.float32, out=part32)
                torch.add(part32.sum(0), b, out=out)

            rows = []
            out.fill_(float("nan"))  # poisoned: the error below is of what bmm + sum wrote
            for label, fn in ((f"bmm {s} f32", bmm32), (f"bmm {s} bf16", bmm16), (f"bmm {s} f32 + sum", bmm32_sum)):
                try:
                    us = per_call_us(fn)
                except Exception as e:  # noqa: BLE001 - a torch without out_dtype for bmm: say so, go on
                    print(f"{name:<8} {label:<22} failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                rows.append((label, us))
            err = (out.float() - want).abs().max().item() / scale
            for label, us in rows:
                e = f"{err:9.2e}" if label.endswith("sum") else ""
                print(f"{name:<8} {label:<22} {us:7.2f} {base / us:9.3f} {e}")


if __name__ == "__main__":
    main()
