"""What the benchmarks share: CUDA-event timers, the matmul peaks (burst and sustained, with the GPU's clocks and
power sampled), the engine benchmarks' batches and backend switch, and result writing.

Importing this module imports torch only (the project's packages load inside the functions that need them), so a
GPU machine without the project's dependencies (pydantic among them) can run the kernel-only experiments.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
import threading
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


def wall_timed(fn, iters: int, warmup: int = 1) -> float:
    """Median milliseconds per call by the host clock (the CPU smoke run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
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
    """The burst peak: TFLOP/s of a bf16 8192³ matmul, median of 10 calls (well under a second: the GPU's clock
    is still at its maximum, before the power cap pulls it down)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, 10)
    return 2 * 8192**3 / ms / 1e9


class GpuSampler:
    """Samples the GPU's SM clock (MHz) and power draw (W) every `interval_s` in a thread while in a `with` block:
    through `torch.cuda.clock_rate()` / `power_draw()` (nvidia-ml-py) where they answer, else `nvidia-smi`, else
    nothing (`source` says which). Samples are (clock MHz, power W); either may be None. `read`: a reader of
    one's own (tests)."""

    def __init__(self, interval_s: float = 0.1, device: int | None = None, read=None):
        self.interval_s, self.samples, self.source = interval_s, [], "given" if read else None
        self.device = device if device is not None else torch.cuda.current_device() if torch.cuda.is_available() else 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read = read or self._pick_reader()

    def _pick_reader(self):
        try:
            torch.cuda.clock_rate(self.device), torch.cuda.power_draw(self.device)
            self.source = "nvml"
            return lambda: (float(torch.cuda.clock_rate(self.device)), torch.cuda.power_draw(self.device) / 1e3)
        except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver, another vendor: try the next source
            pass
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        query = [smi, "-i", str(self.device), "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]

        def read():
            out = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout.strip().splitlines()
            fields = [f.strip() for f in out[0].split(",")] if out else []
            return tuple(_number(f) for f in fields[:2]) if len(fields) >= 2 else (None, None)

        try:
            read()
        except Exception:  # noqa: BLE001
            return None
        self.source = "nvidia-smi"
        return read

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception:  # noqa: BLE001 - one failed sample ends the sampling, never the benchmark
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuSampler:
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self) -> dict:
        """Median, min and max of the clock and the power over the samples (None where none were read)."""
        out: dict = {"gpu_samples": len(self.samples), "gpu_sampler": self.source}
        for i, key in ((0, "sm_mhz"), (1, "power_w")):
            values = [s[i] for s in self.samples if s[i] is not None]
            out[key] = statistics.median(values) if values else None
            out[f"{key}_min"] = min(values) if values else None
            out[f"{key}_max"] = max(values) if values else None
        return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def sustained_peak(rows: int, k: int, n: int, seconds: float = 2.0, dtype=torch.bfloat16) -> dict:
    """The sustained peak: TFLOP/s of one [rows, k] x [k, n] matmul (a tower's largest GEMM) looped for at least
    `seconds` back to back (`per_graph` calls per CUDA graph, so small GEMMs are not held back by launches), after a
    warm-up, with the GPU's clocks and power sampled while it runs. The GPU reaches its power cap and the clock it
    holds there, as a long forward does."""
    a = torch.randn(rows, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    out = torch.empty(rows, n, device="cuda", dtype=dtype)
    per_graph = 20
    graph = graph_of(lambda: torch.mm(a, w.t(), out=out), per_graph)  # x @ W^T, as nn.Linear stores W
    per_replay_ms = timed(graph.replay, 5)
    replays = max(1, -int(-seconds * 1e3 // max(per_replay_ms, 1e-3)))
    calls = replays * per_graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with GpuSampler() as sampler:
        t0 = time.perf_counter()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        wall = time.perf_counter() - t0
    ms = start.elapsed_time(end)
    return {"tflops": 2 * rows * k * n * calls / ms / 1e9, "shape": [rows, k, n], "calls": calls,
            "seconds": ms / 1e3, "wall_s": wall, **sampler.summary()}  # fmt: skip


# ------------------------------------------------------------------------------------------------ engine helpers


def use_backend(enc, name: str) -> None:
    """Every layer of `enc` on backend `name`, or `auto` (per layer kind and graph shape)."""
    from encoder.attention import resolve_attention

    tower = enc.model
    tower.set_backend(resolve_attention(name, tower.attention_kinds, enc.device, enc.dtype, enc.config.head_dim))


def grid_side(enc, side: int, raw: bool = False) -> int:
    """Patches along each side of a square image of `side` pixels as the model's processor sizes it (Qwen3-VL
    scales a 224² image up to 256² for its 65,536-pixel minimum: 16 x 16 patches, not 14 x 14); `raw`: side //
    patch size, the grid of pixels nobody resized (a size Qwen3-VL's processor never makes from 224²)."""
    if raw:
        return side // enc.config.patch_size
    n = enc.num_patches(side, side)
    g = math.isqrt(n)
    assert g * g == n, f"a square {side}² image became {n} patches: not a square grid"
    return g


def make_batch(enc, images: int, side: int, raw: bool = False):
    """`images` random square images of `side` pixels, sized as the model's processor sizes them (`grid_side`),
    as one `encoder.PatchBatch` on the GPU."""
    import encoder

    g = grid_side(enc, side, raw)
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
