"""Do few-row GEMMs run faster when their weights are already in L2? (issue 15: single-image latency)

At one 224² image (256 rows) cuBLAS reads Qwen2.5-VL-7B's block weights at ≈ 1.3–1.5 TB/s, a third of the
H200's HBM bandwidth, on about half the SMs: latency-bound, not bandwidth-bound (docs/journal/benchmarks.md). This
script measures whether reading the *next* GEMM's weights into L2 on a side stream, while the current GEMM runs on the
idle SMs, makes that next GEMM faster. The sequence is 8 blocks × the four bias GEMMs (qkv, proj, gate_up,
down), distinct weights per block (cold, as in a tower), captured in one CUDA graph:

* `plain`: the GEMMs alone;
* `prefetch-P`: before each GEMM, a side stream starts a Triton kernel (P programs) that loads the following
  GEMM's weight with `evict_last` and the graph joins the side stream at the end;
* `warm`: every GEMM reads block 0's weights (39.5 MB: in L2 only as far as they fit), and the
  same with each GEMM repeated `blocks` times in a row (one weight of at most 17.7 MB at a time).

Prints µs per block for each variant and checks that the outputs equal `plain`'s.

    python -m benchmarks.experiments.l2_prefetch [--rows 256] [--blocks 8] [--programs 16,32,64]

Answer (H200, 2026-12-02): no, or very little: with the weights surely in L2 the 256-row GEMMs are at most 7%
faster, a whole block's weights warm in L2 gain nothing, and every prefetch variant is slower; the one-image GEMMs
are bound by their tiling, not HBM.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.common import timed
from benchmarks.experiments.block_gemms import SHAPES
from benchmarks.experiments.graph_gap import captured


@triton.jit
def _touch_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    # every program strides over the tensor (int32 words), keeping what it reads in L2 (evict_last); the sum
    # is stored so the loads are not removed
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def touch(words: torch.Tensor, scratch: torch.Tensor, programs: int) -> None:
    _touch_kernel[(programs,)](words, scratch, words.numel(), BLOCK=2048, PROGRAMS=programs, num_warps=8)


def build(rows: int, blocks: int):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02

    layers = [{k: (rand(n, kk), rand(n)) for k, (kk, n) in SHAPES.items()} for _ in range(blocks)]
    x = rand(rows, 1280)
    return layers, x


def gemm(layer, name: str, x, out) -> None:
    """One GEMM of a block into `out[name]` (down reads the block's gate_up output, the others x)."""
    w, bias = layer[name]
    inp = out["gate_up"][:, : w.shape[1]] if name == "down" else x
    out[name].copy_(F.linear(inp, w, bias))


def sequence(layers, x, outs, before=None):
    """The GEMMs in order; `before(i)` runs just before GEMM i (of 4 * blocks)."""
    i = 0
    for layer, out in zip(layers, outs, strict=True):
        for name in SHAPES:
            if before is not None:
                before(i)
            gemm(layer, name, x, out)
            i += 1


def time_us(replay) -> float:
    return timed(replay, 50) * 1e3  # median µs per replay


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--programs", default="16,32,64")
    args = p.parse_args()
    layers, x = build(args.rows, args.blocks)
    flat = [layer[name][0].view(torch.int32).reshape(-1) for layer in layers for name in SHAPES]

    def new_outs():
        def poisoned(n):  # NaN: an output the graph did not write shows
            return torch.full((args.rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)

        return [{k: poisoned(n) for k, (_, n) in SHAPES.items()} for _ in layers]

    results = {}
    ref = new_outs()
    g = captured(lambda: sequence(layers, x, ref))
    results["plain"] = (time_us(g), ref)

    warm_layers = [layers[0]] * args.blocks
    warm = new_outs()
    g = captured(lambda: sequence(warm_layers, x, warm))
    results["warm (block 0's weights in every block)"] = (time_us(g), None)

    # each GEMM `blocks` times in a row on block 0's weight (at most 17.7 MB, gate_up): surely L2-resident
    repeat = new_outs()

    def same_gemm_in_a_row():
        for name in SHAPES:
            for out in repeat:
                gemm(layers[0], name, x, out)

    g = captured(same_gemm_in_a_row)
    results["warm (each GEMM repeated, one weight at a time)"] = (time_us(g), None)

    for programs in [int(v) for v in args.programs.split(",")]:
        outs = new_outs()
        scratch = torch.empty(programs, device="cuda", dtype=torch.int32)
        side = torch.cuda.Stream()

        def with_prefetch(outs=outs, scratch=scratch, side=side, programs=programs):
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)

            def before(i):
                if i + 1 < len(flat):
                    ev = torch.cuda.Event()
                    ev.record(main_stream)
                    side.wait_event(ev)
                    with torch.cuda.stream(side):
                        touch(flat[i + 1], scratch, programs)

            sequence(layers, x, outs, before)
            main_stream.wait_stream(side)

        g = captured(with_prefetch)
        results[f"prefetch-{programs}"] = (time_us(g), outs)

    base = results["plain"][0]
    print(f"rows {args.rows}, {args.blocks} blocks of Qwen2.5-VL-7B's four bias GEMMs, one CUDA graph")
    print(f"{'variant':<48} {'us/block':>9} {'vs plain':>9}  check")
    for name, (us, outs) in results.items():
        check = ""
        if outs is not None and outs is not ref:
            same = all(torch.equal(o[k], r[k]) for o, r in zip(outs, ref, strict=True) for k in SHAPES)
            check = "equal" if same else "DIFFERENT"
        print(f"{name:<48} {us / args.blocks:9.2f} {base / us:9.3f}x  {check}")


if __name__ == "__main__":
    main()
