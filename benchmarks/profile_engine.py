"""Kernel-time breakdown of one eager forward (CUDA), to see what the graph replay spends on.

Run: `python -m benchmarks.profile_engine --images 1,32 [--side 224] [--model qwen3-vl-8b] [--backend torch_varlen]`.
`--launch`: instead, the host side of one 224x224 image through the replica's path (pinned upload,
patchify, `GraphEncoder.encode_async`): launch time vs launch-to-result, and the CPU ops of the launch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import encoder
from benchmarks.common import grid_side


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--images", default="1,32", help="224x224 images per profiled forward, comma list")
    parser.add_argument("--side", type=int, default=224, help="image side in pixels, as the processor sizes it")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--launch", action="store_true", help="profile the host side of one-image launches")
    parser.add_argument("--graph", action="store_true", help="profile graph replays (GraphEncoder) instead of eager")
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="the tower's block linears in fp8")
    parser.add_argument("--fp8-fast-accum", action="store_true", help="fp8 GEMMs without float32 promotion")
    args = parser.parse_args()
    if args.launch:
        return profile_launch(args)
    if args.fp8_fast_accum:
        from encoder.models.fp8 import Fp8Linear

        Fp8Linear.fast_accum = True
    enc = encoder.load(
        args.model, device="cuda", dtype=torch.bfloat16, attention=args.backend, quantization=args.quantization
    )
    enc.model.fuse(128)
    run = enc.forward_packed
    if args.graph:
        from workspace import GraphEncoder

        graph = GraphEncoder(enc)
        run = lambda b: graph.runner.run(b.pixel_values, b.grid_thw)  # noqa: E731
    g = grid_side(enc, args.side)  # as the model's processor sizes a square image of that side
    for n in map(int, args.images.split(",")):
        grid = torch.tensor([[1, g, g]] * n)
        batch = encoder.PatchBatch(torch.randn(n * g * g, enc.config.patch_dim, device="cuda"), grid)
        for _ in range(3):
            run(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run(batch)
            torch.cuda.synchronize()
        kind = "graph replays" if args.graph else "eager forwards"
        print(f"\n### {n} x {args.side}x{args.side} ({n * g * g} patches), {enc.model.backend.name}, per 5 {kind}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    return 0


def profile_launch(args) -> int:
    from encoder.patchify import stack_patchify
    from workspace import GraphEncoder

    eng = GraphEncoder(encoder.load(args.model, device="cuda", dtype=torch.bfloat16, attention=args.backend))
    pp, dev = eng.encoder.preprocess_config, eng.device
    img = [np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)]

    def launch():
        return eng.encode_async(stack_patchify(img, pp, dev), pooling="mean")

    for _ in range(20):
        launch().result()
    launched, done = [], []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = launch()
        t1 = time.perf_counter()
        pending.result()
        launched.append(t1 - t0)
        done.append(time.perf_counter() - t0)
    print(f"one 224x224 image, idle GPU: launch (host) p50 {statistics.median(launched) * 1e3:.3f} ms, "
          f"launch to result p50 {statistics.median(done) * 1e3:.3f} ms (200 calls)")  # fmt: skip
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            launch()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
