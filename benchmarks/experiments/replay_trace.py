"""Timeline of one bucket's graph replay (one GPU run): every kernel in order, grouped by kind, and the
idle gaps between them, so the single-image latency can be split into GEMM time, small-kernel time,
and launch gaps.

Run: `python -m benchmarks.experiments.replay_trace [--model qwen2.5-vl-7b] [--images 1] [--side 224] [--backend triton]
[--trace out.json]`. Prints the replay time (CUDA events, median), then per kind: kernels per replay, total
µs, mean µs, and the gaps (start of a kernel minus the end of the one before it, inside the replay).

Answer (H200, 2026-12-01 to 12-03): a 1×224² Qwen2.5-VL-7B replay (1.70 ms) is ≈ 1.09 ms of cuBLAS GEMMs, ≈ 0.44 ms
of small per-block kernels (attention, add+norm, rotary, SiLU·up) and ≈ 0.14 ms of launch gaps; the geometry in one
launch took 105 kernels and 0.2 ms out (kept in `encoder/kernels/geometry.py`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict

import torch

import encoder
import workspace
from benchmarks.common import grid_side, make_batch, timed, trace_kernels, use_backend
from benchmarks.experiments.graph_gap import used_shape

KINDS = [  # (kind, regex on the kernel name); first match wins
    ("gemm", r"nvjet|gemm|cutlass|sm90_|Kernel2|xmma|splitK"),
    ("add_norm", r"_add_norm"),
    ("rotary", r"_rotary"),
    ("attention", r"_varlen|flash|attention|fmha"),
    ("silu_mul/act", r"_act_kernel|gelu"),
    ("zero rows", r"_zero_rows"),
    ("index/gather", r"index|gather|scatter|embedding"),
    ("copy/fill", r"copy|fill|Memset|memcpy|CatArray"),
    ("reduce/scan", r"reduce|scan|cumsum|search"),
    ("elementwise", r"elementwise|vectorized"),
]


def kind_of(name: str) -> str:
    return next((k for k, rx in KINDS if re.search(rx, name, re.I)), "other")


def report(ks: list[dict], label: str) -> None:
    per = defaultdict(lambda: [0, 0.0, 0.0])  # kind -> [count, busy µs, gap before µs]
    names = defaultdict(lambda: [0, 0.0])
    prev_end = None
    for e in ks:
        k = kind_of(e["name"])
        gap = 0.0 if prev_end is None else max(0.0, e["ts"] - prev_end)
        per[k][0] += 1
        per[k][1] += e["dur"]
        per[k][2] += gap
        names[e["name"][:80]][0] += 1
        names[e["name"][:80]][1] += e["dur"]
        prev_end = e["ts"] + e["dur"] if prev_end is None else max(prev_end, e["ts"] + e["dur"])
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    busy = sum(v[1] for v in per.values())
    print(f"\n### {label}: {len(ks)} kernels, span {span:.0f} µs, busy {busy:.0f} µs, gaps {span - busy:.0f} µs\n")
    print("| kind | kernels | busy µs | mean µs | gaps before µs |\n| --- | ---: | ---: | ---: | ---: |")
    for k, (n, b, g) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n} | {b:.0f} | {b / n:.2f} | {g:.0f} |")
    print("\n| kernel | calls | µs |\n| --- | ---: | ---: |")
    for name, (n, b) in sorted(names.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"| `{name}` | {n} | {b:.1f} |")
    # the first block's kernels in order (between the first and second add_norm of block 0 and 1)
    norms = [i for i, e in enumerate(ks) if "_add_norm" in e["name"]]
    if len(norms) >= 5:
        print("\n| block 1, in order | µs | gap before µs |\n| --- | ---: | ---: |")
        for i in range(norms[2], norms[4]):
            gap = ks[i]["ts"] - ks[i - 1]["ts"] - ks[i - 1]["dur"]
            print(f"| `{ks[i]['name'][:70]}` | {ks[i]['dur']:.1f} | {gap:.1f} |")
        print(f"\nbefore the first block: {norms[0]} kernels; after the last add_norm: {len(ks) - norms[-1] - 1}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--trace", default="/tmp/replay_trace.json")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    base = encoder.load(args.model, device="cuda", dtype=torch.bfloat16)
    use_backend(base, args.backend)
    batch = make_batch(base, args.images, args.side)
    per = grid_side(base, args.side) ** 2
    total = args.images * per
    with torch.inference_mode():
        graph = workspace.GraphEncoder(base, buckets=[total])
        replay = graph.runner.graphs[used_shape(graph, args.images, per)].replay
        run = lambda: graph.runner.run(batch.pixel_values, batch.grid_thw)  # noqa: E731
        ms = [timed(replay, args.iters) for _ in range(3)]
        ms_run = timed(run, args.iters)
        print(f"## {args.model} {args.images}x{args.side}² ({total} patches), {args.backend}: replay "
              f"{statistics.median(ms):.3f} ms (3 medians {', '.join(f'{m:.3f}' for m in ms)}), "
              f"runner.run {ms_run:.3f} ms")  # fmt: skip
        report(trace_kernels(replay, args.trace), "one replay")
    return 0


if __name__ == "__main__":
    sys.exit(main())
