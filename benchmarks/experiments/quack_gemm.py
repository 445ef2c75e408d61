"""Bias GEMMs at one image's rows and at 8 x 896²'s: cuBLAS (`F.linear`, bias in cuBLASLt's epilogue) against
quack's CuTe-DSL GEMM for Hopper (`quack-kernels`, which FlashAttention-4 depends on) with its in-kernel split-K
(issues 15 and 14).

Per shape and quack config (tile, pingpong or cooperative, cluster, swap A/B, split-K factor in SERIAL mode:
partial sums ordered by a turnstile, bitwise deterministic, no second kernel), 20 calls per CUDA graph, µs per
call; every output is checked against float32 (`max |out - ref| / max |ref|`) into a NaN-poisoned buffer.
Then a block's four GEMMs in sequence, cuBLAS vs the best quack config per shape. Needs a Hopper GPU and
`quack-kernels` (the FA4 pack: ../shared/device/pack-fa4.sh, plus einops).

    python -m benchmarks.experiments.quack_gemm --models qwen2.5-vl-7b,qwen3-vl-8b-8x896 --out results.json

Answer (H200, 2026-12-02): at 25,088 rows quack's 128×192 pingpong GEMM beats cuBLAS on all four Qwen3-VL-8B block
GEMMs (−8% a block), but in the tower it gained only 0.9% (8×896²) and 1.5% (32×224²); at 256 rows cuBLAS wins and
quack's split-K never does: not built.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import per_call_us

MODELS = {  # name: (rows of one 224² image, {gemm: (K, N)})
    "qwen2.5-vl-7b": (256, {"qkv": (1280, 3840), "proj": (1280, 1280), "gate_up": (1280, 6912), "down": (3456, 1280)}),
    "qwen3-vl-8b-8x896": (25088, {"qkv": (1152, 3456), "proj": (1152, 1152), "fc1": (1152, 4352), "fc2": (4352, 1152)}),
    "clip-vit-l-14": (257, {"qkv": (1024, 3072), "proj": (1024, 1024), "fc1": (1024, 4096), "fc2": (4096, 1024)}),
}
FEW_ROWS = 4096  # at most this many rows: small tiles, swapped operands and split-K are tried


def candidates(rows: int):
    from quack.gemm_config import GemmConfig

    base = []
    few = rows <= FEW_ROWS  # many rows: quack's own large tiles
    small = ((128, 128, True), (128, 64, True), (128, 192, True))
    large = ((256, 128, False), (256, 192, False), (128, 192, True), (128, 256, False))
    tiles = small if few else large
    clusters = ((1, 1), (2, 1)) if few else ((2, 1), (1, 2))
    for tile_m, tile_n, pingpong in tiles:
        for cluster_m, cluster_n in clusters:
            for swap in (False, True) if few else (False,):
                base.append(
                    GemmConfig(
                        tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m, cluster_n=cluster_n,
                        swap_ab=swap, device_capacity=9, is_dynamic_persistent=False, use_tma_gather=False,
                    )
                )  # fmt: skip
    return base


def label(cfg, split: int) -> str:
    kind = "pp" if cfg.pingpong else "coop"
    return f"{cfg.tile_m}x{cfg.tile_n} {kind} c{cfg.cluster_m}{cfg.cluster_n}{' swap' if cfg.swap_ab else ''} s{split}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen2.5-vl-7b,clip-vit-l-14,qwen3-vl-8b-8x896")
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop trying configs after this long")
    p.add_argument("--out", default="quack_gemm.json")
    p.add_argument("--verbose", action="store_true", help="print the traceback of each config that fails")
    args = p.parse_args()
    from quack.gemm_interface import SplitKMode, gemm_tuned

    torch.manual_seed(0)
    splits = [int(s) for s in args.splits.split(",")]
    started = time.monotonic()
    results: dict = {"device": torch.cuda.get_device_name(), "models": {}}
    for model in args.models.split(","):
        rows, shapes = MODELS[model]
        per_model = results["models"].setdefault(model, {"rows": rows, "gemms": {}})
        best_fns, cublas_fns = {}, []
        for name, (k, n) in shapes.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float(), bias.float())
            scale = ref.abs().max().item()
            out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            cublas_err = (F.linear(x, w, bias).float() - ref).abs().max().item() / scale
            cublas_fn = lambda x=x, w=w, b=bias: F.linear(x, w, b)  # noqa: E731
            cublas = per_call_us(cublas_fn)
            row = {"cublas_us": cublas, "cublas_err": cublas_err, "quack": {}}
            best = (cublas, "cublas", cublas_fn)
            cublas_fns.append(cublas_fn)
            for cfg in candidates(rows):
                for split in splits if rows <= FEW_ROWS else (1,):
                    if time.monotonic() - started > args.budget_s:
                        break
                    key = label(cfg, split)

                    def fn(x=x, w=w, b=bias, out=out, cfg=cfg, split=split):
                        gemm_tuned.fn(x, w.t(), out, bias=b, config=cfg, split_k=split, split_k_mode=SplitKMode.SERIAL)

                    try:
                        out.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        err = (out.float() - ref).abs().max().item() / scale
                        if not err < 1e-2:  # NaN included: something was not written
                            row["quack"][key] = {"error": f"wrong: {err}"}
                            continue
                        us = per_call_us(fn)
                        row["quack"][key] = {"us": us, "err": err}
                        if us < best[0]:
                            best = (us, key, fn)
                    except Exception as e:  # noqa: BLE001 - report the config and go on
                        row["quack"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                        if args.verbose:
                            traceback.print_exc()
            row["best"] = best[1]
            row["best_us"] = best[0]
            best_fns[name] = best[2]
            per_model["gemms"][name] = row
            ok = {k: v["us"] for k, v in row["quack"].items() if "us" in v}
            top = sorted(ok.items(), key=lambda kv: kv[1])[:4]
            print(
                f"{model} {name} ({rows}x{k}->{n}): cuBLAS {cublas:.2f} µs; quack best "
                + ", ".join(f"{k} {v:.2f}" for k, v in top)
                + f"; {len(ok)} of {len(row['quack'])} configs ran",
                flush=True,
            )
        # a block's GEMMs in sequence (each shape's own buffers): cuBLAS for all, then each shape's best
        seq_cublas = per_call_us(lambda fns=cublas_fns: [f() for f in fns], calls=8)
        seq_best = per_call_us(lambda fns=best_fns: [f() for f in fns.values()], calls=8)
        per_model["block_cublas_us"], per_model["block_best_us"] = seq_cublas, seq_best
        print(f"{model}: a block's GEMMs in sequence, cuBLAS {seq_cublas:.2f} µs, best per shape {seq_best:.2f} µs")
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
