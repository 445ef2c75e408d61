"""The benchmarks' two timers, with nothing but torch imported (so a GPU machine without the project's
dependencies, pydantic among them, can run the kernel-only benchmarks that use them)."""

from __future__ import annotations

import statistics

import torch


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def per_call_us(fn, calls: int = 20, reps: int = 30) -> float:
    """µs per call of `fn`: `calls` of it captured in one CUDA graph (after a warm-up call on a side stream,
    as capture needs), median of `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return timed(g.replay, reps) * 1e3 / calls
