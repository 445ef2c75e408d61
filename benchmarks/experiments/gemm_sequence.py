"""Do a block's GEMMs pay for the kernels around them? (issue 15: one 224² image, Qwen2.5-VL-7B shapes)

In a 1×224² replay a block's four cuBLAS GEMMs take ≈ 34 µs, where the same four timed alone (20 identical calls
per CUDA graph) add up to ≈ 30 µs (docs/journal/benchmarks.md, fourth and fourteenth sessions): ≈ 4 µs a block, ≈ 130 µs
a replay, lost to whatever running *different* kernels one after another costs (instruction caches, the SM's
shared-memory/L1 split switching between kernels that want different carveouts, ...). This script measures that
in CUDA graphs at 256 rows, 8 layers' distinct weights, bf16, µs per layer:

* `alone`: each GEMM / small kernel 20 times in a row (the isolated reference);
* `A`: the four GEMMs in block order (qkv, proj, gate_up, down) per layer;
* `B`: the same 32 GEMMs grouped by kind (8 qkv, then 8 proj, ...): 3 kernel switches instead of 31;
* `C`: a block without attention and rotary: A with the block's Triton kernels between (add+norm after proj and
  down, SiLU·up after gate_up);
* `D` / `E`: C with those Triton kernels' preferred shared-memory carveout set to 100% / 0%
  (`cuFuncSetAttribute(..., CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)`).

Then one replay of A and of C under torch's profiler: each kernel's device time in the sequence against alone.

`python -m benchmarks.experiments.gemm_sequence` (torch and triton only:
encoder/kernels/elementwise.py is loaded by path)

Answer (H200, 2026-12-03): the SM carveout is not the cause (100% changes nothing, 0% costs 1.2 µs a layer);
switching between GEMM kernels costs ≈ 0.8 µs a layer, fixed by the block's data order, and the rest of the
in-sequence gap (≈ 2.4 µs) comes from other weights, not other kernels: no lever.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import graph_of, per_call_us, trace_kernels

ROOT = Path(__file__).resolve().parents[2]

spec = importlib.util.spec_from_file_location("encoder_kernels", ROOT / "encoder" / "kernels" / "elementwise.py")
K = importlib.util.module_from_spec(spec)
spec.loader.exec_module(K)

ROWS, D, F_MLP, LAYERS = 256, 1280, 3456, 8
SHAPES = {"qkv": (D, 3 * D), "proj": (D, D), "gate_up": (D, 2 * F_MLP), "down": (F_MLP, D)}
CARVEOUT_ATTR = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()  # no options; --help says what it measures
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    w, b = {}, {}
    for kind, (k, n) in SHAPES.items():
        w[kind] = [torch.randn(n, k, device=dev, dtype=bf16) / k**0.5 for _ in range(LAYERS)]
        b[kind] = [torch.randn(n, device=dev, dtype=bf16) for _ in range(LAYERS)]
    norm_w = torch.rand(D, device=dev, dtype=bf16) + 0.5
    x = torch.randn(ROWS, D, device=dev, dtype=bf16)
    h = torch.randn(ROWS, F_MLP, device=dev, dtype=bf16)
    inputs = {"qkv": x, "proj": x, "gate_up": x, "down": h}
    residual = torch.randn(ROWS, D, device=dev, dtype=torch.float32)

    def gemm(kind: str, layer: int, inp=None):
        return F.linear(inputs[kind] if inp is None else inp, w[kind][layer], b[kind][layer])

    def block_order():
        for layer in range(LAYERS):
            for kind in SHAPES:
                gemm(kind, layer)

    def grouped():
        for kind in SHAPES:
            for layer in range(LAYERS):
                gemm(kind, layer)

    def mini_blocks():
        r, xn = residual, x
        for layer in range(LAYERS):
            gemm("qkv", layer, xn)
            p = gemm("proj", layer)  # the attention's output stands in as x
            r, xn = K.add_norm(p, r, norm_w, None, 1e-6, rms=True)
            gu = gemm("gate_up", layer, xn)
            d = gemm("down", layer, K.silu_mul(gu))
            r, xn = K.add_norm(d, r, norm_w, None, 1e-6, rms=True)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    alone = {kind: per_call_us(lambda kind=kind: gemm(kind, 0)) for kind in SHAPES}
    gu0 = gemm("gate_up", 0)
    alone["add_norm"] = per_call_us(lambda: K.add_norm(x, residual, norm_w, None, 1e-6, rms=True))
    alone["silu_mul"] = per_call_us(lambda: K.silu_mul(gu0))
    print("alone, µs per call: " + ", ".join(f"{k} {v:.2f}" for k, v in alone.items()), flush=True)
    gemms_alone = sum(alone[k] for k in SHAPES)
    small_alone = 2 * alone["add_norm"] + alone["silu_mul"]

    def row(name: str, fn, expected: float) -> float:
        us = per_call_us(fn, calls=5) / LAYERS
        print(f"{name}: {us:.2f} µs per layer (the parts alone: {expected:.2f}; +{us - expected:.2f})", flush=True)
        return us

    rounds = defaultdict(list)
    for _ in range(3):  # interleaved rounds: the GPU's clock drifts over a call
        rounds["A block order"].append(row("A block order", block_order, gemms_alone))
        rounds["B grouped"].append(row("B grouped", grouped, gemms_alone))
        rounds["C mini blocks"].append(row("C mini blocks", mini_blocks, gemms_alone + small_alone))

    # the Triton kernels' functions (launched once more to get their compiled handles)
    gu = gemm("gate_up", 0)
    out = torch.empty(ROWS, F_MLP, device=dev, dtype=bf16)
    total, normed = torch.empty_like(residual), torch.empty_like(x)
    k_norm = K._add_norm_kernel[(ROWS,)](x, residual, norm_w, norm_w, total, normed, D, 1e-6,
                                         HAS_RES=True, RMS=True, BLOCK=2048, num_warps=4)  # fmt: skip
    k_act = K._act_kernel[(ROWS, (F_MLP + 1023) // 1024)](gu, out, F_MLP, GATED=True, BLOCK=1024, num_warps=4)
    libcuda = ctypes.CDLL("libcuda.so.1")
    for percent, name in ((100, "D carveout 100%"), (0, "E carveout 0%")):
        for k in (k_norm, k_act):
            k._init_handles()
            status = libcuda.cuFuncSetAttribute(ctypes.c_void_p(k.function), CARVEOUT_ATTR, ctypes.c_int(percent))
            assert status == 0, f"cuFuncSetAttribute: {status}"
        for _ in range(3):
            rounds[name].append(row(name, mini_blocks, gemms_alone + small_alone))
    for percent in (-1,):  # back to the driver's default for the trace
        for k in (k_norm, k_act):
            libcuda.cuFuncSetAttribute(ctypes.c_void_p(k.function), CARVEOUT_ATTR, ctypes.c_int(percent))

    print("\nmedians, µs per layer: " + "; ".join(f"{k} {sorted(v)[1]:.2f}" for k, v in rounds.items()), flush=True)
    trace(block_order, "A")
    trace(mini_blocks, "C")
    return 0


def trace(fn, name: str) -> None:
    """Each kernel's device time in one replay of `fn`'s graph, by kernel name (µs per layer), and the idle gaps
    between kernels."""
    traced = trace_kernels(graph_of(fn).replay, str(Path(tempfile.mkdtemp()) / "trace.json"))
    kernels = [e for e in traced if e["cat"] == "kernel"]  # no memsets or copies
    by_name = defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(e["dur"])
    print(f"\ntrace {name}: {len(kernels)} kernels", flush=True)
    for kname, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        per_layer, mean = sum(times) / LAYERS, sum(times) / len(times)
        print(f"  {per_layer:7.2f} µs/layer {len(times):3d}x mean {mean:6.2f}  {kname[:100]}")
    gaps = sum(max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(kernels, kernels[1:], strict=False))
    print(f"  gaps between kernels {gaps / LAYERS:.2f} µs/layer", flush=True)


if __name__ == "__main__":
    sys.exit(main())
