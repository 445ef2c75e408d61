"""Where graph replay loses to eager (one GPU run): the same batch through the same tower, timed in
interleaved rounds in one process, so clocks and thermals are shared:

* eager: `VisionEncoder.run_packed` (the model as loaded, then after `fuse()`),
* runner: `GraphRunner.run` (host packing + copies + replay),
* replay: the bucket's `CUDAGraph.replay()` alone,
* own graph: `forward_packed` captured by this script with the batch's exact bounds, in a private pool,

plus isolated GEMM / add+norm kernels eager vs captured, the SM clock and power sampled by nvidia-smi per
phase, and a kernel table of one eager forward beside one replay (same process).

Run: `python -m benchmarks.experiments.graph_gap --model qwen3-vl-8b --images 8 --side 896`.

Answer (H200, 2026-12-01): graph replay is not slower than eager in one process (Qwen3-VL-8B 8×896²: replay 68.97
ms, eager 69.75); the earlier gap was two machines' states. The GPU runs at its 700 W cap (SM 1,610–1,670 MHz
against 1,980 idle), so the 45%-MFU bar is a kernel-time problem at the power limit. Again (H100, 2026-12-07),
32 x 14² grids in their own 6,272 bucket: replay 14.77 ms, runner 15.06, eager 16.70; the slow 32 x 224² rows
came from padding into the default 8,192 bucket and the runner's exact-size eager pack, not from the graph.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import encoder
import encoder.models.geometry
import workspace
from benchmarks.common import grid_side, make_batch, timed, use_backend
from benchmarks.flops import linear_flops
from encoder.kernels.elementwise import add_norm, linear_gelu_tanh

MARKS: list[tuple[float, str]] = []


def mark(name: str) -> None:
    torch.cuda.synchronize()
    MARKS.append((time.time(), name))


def captured(fn):
    """fn captured in its own graph (private pool) after a warm-up on a side stream; returns replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def rounds(cases: dict, n: int, iters: int) -> dict[str, float]:
    """Median over `n` interleaved rounds of each case's median ms."""
    got: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(n):
        for name, fn in cases.items():
            mark(f"start {name}")
            got[name].append(timed(fn, iters, warmup=2))
            mark(f"end {name}")
    return {k: statistics.median(v) for k, v in got.items()}


def kernel_table(fn, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    print(f"\n### kernels, 2 x {label}\n")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90))


def isolated(S: int, D: int, F_: int) -> None:
    """GEMM and add+norm shapes of one block, 16 in a row, eager vs captured."""
    x = torch.randn(S, D, device="cuda", dtype=torch.bfloat16)
    qkv = torch.nn.Linear(D, 3 * D, device="cuda", dtype=torch.bfloat16)
    fc1 = torch.nn.Linear(D, F_, device="cuda", dtype=torch.bfloat16)
    fc1p = torch.nn.Linear(D, -(-F_ // 128) * 128, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(S, D, device="cuda", dtype=torch.float32)
    w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(D, device="cuda", dtype=torch.bfloat16)
    cases = {
        f"qkv bias GEMM {S}x{D}->{3 * D}": lambda: [F.linear(x, qkv.weight, qkv.bias) for _ in range(16)],
        f"fc1+gelu GEMM ->{F_}": lambda: [linear_gelu_tanh(x, fc1) for _ in range(16)],
        f"fc1+gelu GEMM ->{fc1p.out_features} (padded)": lambda: [linear_gelu_tanh(x, fc1p) for _ in range(16)],
        "add_norm": lambda: [add_norm(x, res, w, b, 1e-6, False) for _ in range(16)],
    }
    print("\n### isolated kernels (16 calls; ms per call)\n\n| case | eager | graph |\n| --- | ---: | ---: |")
    for name, fn in cases.items():
        replay = captured(fn)
        r = rounds({"eager": fn, "graph": replay}, 3, 5)
        print(f"| {name} | {r['eager'] / 16:.4f} | {r['graph'] / 16:.4f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-vl-8b")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--side", type=int, default=896)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--smi", default="/tmp/smi.csv")
    args = parser.parse_args()
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu",
         "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=open(args.smi, "w"), stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        return run(args)
    finally:
        smi.terminate()
        summarize_clocks(args.smi)


def run(args) -> int:
    torch.backends.cuda.matmul.allow_tf32 = True
    base = encoder.load(args.model, device="cuda", dtype=torch.bfloat16)
    use_backend(base, args.backend)
    cfg = base.config
    batch = make_batch(base, args.images, args.side)
    per = grid_side(base, args.side) ** 2
    total = args.images * per
    buckets = [total]
    tower = base.model
    frames = encoder.models.geometry.frames_of(batch.grid_thw).to("cuda")
    pv = batch.pixel_values
    bounds = tower.batch_bounds(batch.grid_thw.tolist())  # host values: read before any capture
    results: dict[str, float] = {}

    with torch.inference_mode():

        def phase(pad_mlp: int | None, suffix: str, eager: str):
            """Eager, runner, replay alone and own capture of one MLP layout, in interleaved rounds."""
            kw = {} if pad_mlp is None else {"pad_mlp": pad_mlp}
            graph = workspace.GraphEncoder(base, buckets=buckets, **kw)
            shape = used_shape(graph, args.images, per)
            cases = {
                eager: lambda: base.run_packed(batch),
                f"runner.run{suffix}": lambda: graph.runner.run(batch.pixel_values, batch.grid_thw),
                f"replay{suffix}": graph.runner.graphs[shape].replay,
                f"own graph{suffix}": captured(lambda: tower.forward_packed(pv, frames, bounds)),
            }
            results.update(rounds(cases, args.rounds, args.iters))
            print(f"graph shapes captured: {len(graph.runner.graphs)}; replayed {shape}", flush=True)
            return graph, shape

        phase(0, " (pad 0)", "eager (as loaded)")  # its graphs go before the layout change below
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        g, shape = phase(None, "", "eager (fused)")  # the default GraphEncoder: MLP width padded
        flops = linear_flops(cfg, total)
        print(f"\n## {args.model} {args.images}x{args.side}² ({total} patches), backend {args.backend}\n")
        print("| case | ms | TFLOP/s (linear) |\n| --- | ---: | ---: |")
        for k, v in results.items():
            print(f"| {k} | {v:.2f} | {flops / v / 1e9:.0f} |")
        sys.stdout.flush()
        kernel_table(lambda: base.run_packed(batch), "eager (fused)", args.rows)
        kernel_table(g.runner.graphs[shape].replay, "replay", args.rows)
        g = None
        torch.cuda.empty_cache()
        isolated(total, cfg.width, cfg.mlp_dim)
    return 0


def used_shape(graph, images: int, per: int):
    """The graph shape the runner replays for `images` images of `per` patches each."""
    runner = graph.runner
    (key,) = runner.table.keys
    return next(s for s in runner.shapes[key] if s.holds(images, per))


def summarize_clocks(path: str) -> None:
    rows = []
    for line in Path(path).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0
            rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])))
        except (ValueError, IndexError):
            continue
    if not rows:
        print("no nvidia-smi samples")
        return
    print("\n### SM clock / power per phase (nvidia-smi, 100 ms samples)\n")
    print("| phase | samples | SM MHz | mem MHz | W | °C |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    agg: dict[str, list] = {}
    for (t0, a), (t1, _) in zip(MARKS, MARKS[1:], strict=False):
        if not a.startswith("start "):
            continue
        name = a[6:]
        agg.setdefault(name, []).extend(r for r in rows if t0 <= r[0] <= t1)
    for name, rs in agg.items():
        if rs:
            mean = [statistics.mean(r[i] for r in rs) for i in range(1, 5)]
            print(f"| {name} | {len(rs)} | {mean[0]:.0f} | {mean[1]:.0f} | {mean[2]:.0f} | {mean[3]:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
