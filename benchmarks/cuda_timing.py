"""The benchmarks' two timers, with nothing but torch imported (so a GPU machine without the project's
dependencies, pydantic among them, can run the kernel-only benchmarks that use them)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

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


def graph_of(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """`calls` calls of `fn` captured in one CUDA graph, after a warm-up call on a side stream (as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def per_call_us(fn, calls: int = 20, reps: int = 30) -> float:
    """µs per call of `fn`: `calls` of it captured in one CUDA graph, median of `reps` replays."""
    return timed(graph_of(fn, calls).replay, reps) * 1e3 / calls


def trace_kernels(fn, path: str) -> list[dict]:
    """Kernels of one call of `fn` (after a warm-up call), in start order: the chrome-trace events of torch's
    profiler, each with its `name`, `ts` and `dur` (µs)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    events = json.loads(Path(path).read_text())["traceEvents"]
    ks = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
    return sorted(ks, key=lambda e: e["ts"])
