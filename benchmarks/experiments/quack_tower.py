"""Qwen3-VL-8B's blocks with quack's CuTe-DSL GEMMs, in the tower, against cuBLAS (issue 14's 45% MFU).

The ninth session measured quack's 128x192 pingpong GEMM faster than cuBLAS on a block's four GEMMs at
25,088 rows (8x896²), but only three of them ran in the tower (fc1 kept cuBLASLt's GELU epilogue) and the
forward gained 0.9%. Two levers were not tried, and this script measures both, same process, graph replay,
variants interleaved so the GPU's power state is shared:

* `quack`: every block GEMM on quack for buckets of >= MIN_ROWS rows, fc1 through `gemm_act` with the tanh
  GELU in its epilogue;
* `quack+res`: the same, and the attention's residual add moved into the proj GEMM's epilogue: it reads the
  float32 residual stream as its C operand and writes the new stream in float32, so the norm after it reads
  4 bytes an element and writes 2 (instead of reading 2 + 4 and writing 4 + 2 in add+norm).

Smaller buckets stay on cuBLAS in every variant (1x224² is the control). Each variant's tokens are checked
against cuBLAS's on the same batch. Variants are patched onto the blocks here only (no engine change).
Needs an H200 (sm90), FlashAttention-4 and quack (../shared/device/pack-fa4.sh). Add the unpacked wheels'
directory through a path that contains `site-packages` (a symlink `/tmp/q/site-packages -> /tmp/fa4`, then
`site.addsitedir('/tmp/q/site-packages')`): quack keys its compile cache on the globals of every function
outside a site-packages directory, and the CuTe-DSL's cannot be keyed (TypeError at the first GEMM).

    python -m benchmarks.experiments.quack_tower --rounds 3 --iters 20

Answer (H200, 2026-12-03): fc1 on quack's `gemm_act` gains 0.8% at 8×896² (3.9% at 32×224²) and the residual in
proj's epilogue gives it back; at 8×896² the H200 runs at its 700 W cap (SM 1,425–1,695 MHz), so the forward's
energy, not a kernel's schedule, decides its time: not built.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

import encoder
import workspace
from benchmarks.common import WORKLOADS, make_batch, matmul_peak, timed, use_backend
from benchmarks.flops import linear_flops
from encoder.kernels.elementwise import add_norm, rotary_qkv
from encoder.models.qwen2 import norm_args

MIN_ROWS = 4096
MODE = {"name": "cublas"}  # read at capture time by the patched block forward


def quack_config(cluster_m: int, cluster_n: int):
    from quack.gemm_config import GemmConfig

    return GemmConfig(
        tile_m=128, tile_n=192, pingpong=True, cluster_m=cluster_m, cluster_n=cluster_n, swap_ab=False,
        device_capacity=9, is_dynamic_persistent=False, use_tma_gather=False,
    )  # fmt: skip


def patch_blocks(tower) -> dict:
    """Give every block a forward that follows MODE; returns the per-GEMM quack configs it uses."""
    from quack.gemm_interface import gemm_act, gemm_tuned

    # the ninth session's best cluster per shape at 25,088 rows (docs/journal/benchmarks.md)
    cfg = {"qkv": quack_config(1, 2), "proj": quack_config(2, 1), "fc1": quack_config(2, 1), "fc2": quack_config(1, 2)}

    def linear(x, lin, which, c=None, out_dtype=None):
        # x: [S, K] contiguous, lin.weight [N, K] -> [S, N] (+ c) in out_dtype
        out = torch.empty(x.shape[0], lin.out_features, dtype=out_dtype or x.dtype, device=x.device)
        gemm_tuned.fn(x, lin.weight.t(), out, c, bias=lin.bias, config=cfg[which])
        return out

    def linear_gelu(x, lin):
        out = torch.empty(x.shape[0], lin.out_features, dtype=x.dtype, device=x.device)
        gemm_act(
            x, lin.weight.t(), bias=lin.bias, activation="gelu_tanh_approx", postact_out=out, store_preact=False,
            tuned=False, config=cfg["fc1"],
        )  # fmt: skip
        return out

    def forward(blk, x, delta, meta):
        if MODE["name"] == "cublas" or x.shape[0] < MIN_ROWS:
            return type(blk).forward(blk, x, delta, meta)
        x, h = add_norm(x, delta, *norm_args(blk.norm1))
        attn = blk.attn
        s, d = h.shape
        out = torch.empty(s, attn.num_heads, d // attn.num_heads, dtype=h.dtype, device=h.device)
        q, k, v = rotary_qkv(linear(h, attn.qkv, "qkv"), meta.cos, meta.sin, attn.num_heads, out, meta.cu_seqlens)
        attn.backend(q, k, v, meta.cu_seqlens, meta.max_seqlen, out)
        if MODE["name"] == "quack+res":  # x (float32) + out @ Wp.T + bp, written in float32
            x = linear(out.view(s, d), attn.proj, "proj", c=x, out_dtype=torch.float32)
            x, h = add_norm(x, None, *norm_args(blk.norm2))
        else:
            x, h = add_norm(linear(out.view(s, d), attn.proj, "proj"), x, *norm_args(blk.norm2))
        return x, linear(linear_gelu(h, blk.mlp.linear_fc1), blk.mlp.linear_fc2, "fc2")

    for blk in tower.blocks:
        blk.forward = types.MethodType(forward, blk)
    return {k: repr(v) for k, v in cfg.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3-vl-8b")
    p.add_argument("--variants", default="cublas,quack,quack+res")
    p.add_argument("--workloads", default="8x896,32x224,1x224")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="quack_tower.json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    peak_start = matmul_peak()
    base = encoder.load(args.model, device="cuda", dtype=torch.bfloat16)
    use_backend(base, "auto")
    per_patch = linear_flops(base.config, base.config.merge_unit) / base.config.merge_unit
    workloads = args.workloads.split(",")
    batches = {wl: make_batch(base, *WORKLOADS[wl]) for wl in workloads}
    graphs, setup, results = {}, {}, {"model": args.model, "device": torch.cuda.get_device_name()}
    for name in args.variants.split(","):
        MODE["name"] = name
        if name != "cublas" and "configs" not in results:
            base.model.fuse()  # the layout every GraphEncoder makes, before the blocks' forwards are replaced
            results["configs"] = patch_blocks(base.model)
        t0 = time.perf_counter()
        try:
            graphs[name] = workspace.GraphEncoder(base)
        except Exception as e:  # noqa: BLE001 - report and measure the others
            results.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:600]}"
            print(f"{name}: capture failed: {results['errors'][name]}", flush=True)
            continue
        setup[name] = time.perf_counter() - t0
        print(f"{name}: captured in {setup[name]:.1f} s", flush=True)
    results["setup_s"] = setup
    # correctness: every variant's tokens against cuBLAS's, same batch (bf16 both)
    check = {}
    for wl, b in batches.items():
        ref = torch.cat(graphs["cublas"].runner.run(b.pixel_values, b.grid_thw)[0]).float()
        for name, g in graphs.items():
            got = torch.cat(g.runner.run(b.pixel_values, b.grid_thw)[0]).float()
            check[f"{name} {wl}"] = ((got - ref).norm() / ref.norm()).item()
    results["rel_err_vs_cublas"] = check
    print(json.dumps(check), flush=True)
    times: dict = {f"{n} {wl}": [] for n in graphs for wl in workloads}
    for _ in range(args.rounds):
        for wl, b in batches.items():
            for name, g in graphs.items():
                run = lambda b=b, g=g: g.runner.run(b.pixel_values, b.grid_thw)  # noqa: E731
                times[f"{name} {wl}"].append(timed(run, args.iters))
    peak_end = matmul_peak()
    results.update(peak_start=peak_start, peak_end=peak_end, times_ms=times)
    print(f"\nmatmul peak {peak_start:.0f} TFLOP/s at the start, {peak_end:.0f} at the end\n")
    print("| variant | workload | ms per round | median ms | patches/s | MFU (start peak) |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for key, ts in times.items():
        name, wl = key.split(" ")
        images, side = WORKLOADS[wl]
        patches = images * (side // base.config.patch_size) ** 2
        ms = statistics.median(ts)
        mfu = per_patch * patches / ms / 1e9 / peak_start
        print(f"| {name} | {wl} | {' / '.join(f'{t:.2f}' for t in ts)} | {ms:.2f} | {patches / ms * 1e3:,.0f} | "
              f"{mfu * 100:.1f}% |")  # fmt: skip
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
