"""What the benchmarks share: CUDA-event timers, the matmul peak, the engine benchmarks' batches and backend switch,
and result writing.

Importing this module imports torch only (the project's packages load inside the functions that need them), so a
GPU machine without the project's dependencies (pydantic among them) can run the kernel-only experiments.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

WORKLOADS = {  # name -> (images, side in pixels)
    "1x224": (1, 224),
    "1x448": (1, 448),
    "32x224": (32, 224),
    "8x896": (8, 896),
}


def require_cuda(script: str) -> bool:
    """False (after saying so on stderr) where there is no CUDA GPU: the scripts then exit 2."""
    if torch.cuda.is_available():
        return True
    print(f"{script} needs a CUDA GPU", file=sys.stderr)
    return False


# ------------------------------------------------------------------------------------------------ timers


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


# ------------------------------------------------------------------------------------------------ peaks


def matmul_peak() -> float:
    """TFLOP/s of a bf16 8192³ matmul, median of 10 calls."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, 10)
    return 2 * 8192**3 / ms / 1e9


# ------------------------------------------------------------------------------------------------ engine helpers


def use_backend(enc, name: str) -> None:
    """Every layer of `enc` on backend `name`, or `auto` (per layer kind and graph shape)."""
    from encoder.attention import resolve_attention

    tower = enc.model
    tower.set_backend(resolve_attention(name, tower.attention_kinds, enc.device, enc.dtype, enc.config.head_dim))


def make_batch(enc, images: int, side: int):
    """`images` random square images of `side` pixels as one `encoder.PatchBatch` on the GPU."""
    import encoder

    g = side // enc.config.patch_size
    grid = torch.tensor([[1, g, g]] * images, device="cuda")  # HF builds positions on grid_thw's device
    pv = torch.randn(images * g * g, enc.config.patch_dim, device="cuda")
    return encoder.PatchBatch(pv, grid)


# ------------------------------------------------------------------------------------------------ results


def markdown_table(header: list[str], rows: list[list[str]], right: int = 1) -> str:
    """A markdown table; every column from `right` on is right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(json_path: str | None, payload: dict, markdown_path: str | None = None, markdown: str = "") -> None:
    """The run's results as JSON (with the GPU, torch version and time), and its markdown table, where asked."""
    if json_path:
        meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "torch": torch.__version__, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        Path(json_path).write_text(json.dumps({**meta, **payload}, indent=1))
    if markdown_path:
        Path(markdown_path).write_text(markdown + "\n")
