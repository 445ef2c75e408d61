"""Cold start of README command 1 (one GPU box): `python -m deployments model=<checkpoint>` started in a fresh
process, timed to its ready line and to `/health` 200, then stopped with Ctrl-C; `--starts` times over.

The first start is the box's first ever (compiled-kernel caches empty: Triton's, FA4's) when run on a fresh
machine; it is reported apart from the median of the others. Each start's launcher output is kept with the
second each line arrived (`--log-dir`), which shows where its time goes (Ray up, application checked,
replicas ready). `benchmarks/startup.py` splits the replica's own part (weights, capture).

    python -m benchmarks.cold_start --model /tmp/ckpt-7b [--starts 4] [KEY=VALUE ...]

With a preset name (`--export qwen2.5-vl-7b`), the preset's random weights are first written as a local
checkpoint directory (`benchmarks.batch.export_preset`): what a user's own checkpoint on disk looks like.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from deployments.ray_compat import FAST_PATH_ENV, LAUNCHER_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def one_start(model: str, extra: list[str], log_path: Path, timeout_s: float) -> dict:
    """One launcher from a fresh process: seconds to its ready line and to /health 200, and to stop."""
    port = free_port()
    # as a newcomer runs it: none of Serve's variables, no cluster address
    env = {k: v for k, v in os.environ.items() if k not in {*FAST_PATH_ENV, *LAUNCHER_ENV, "RAY_ADDRESS"}}
    cmd = [sys.executable, "-m", "deployments", "--port", str(port), f"model={model}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    ready = threading.Event()

    def read() -> None:  # each output line with the second it arrived
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            if "vision service ready" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    result = {"port": port}
    while not healthy(port):
        if proc.poll() is not None:
            result["error"] = f"exited with {proc.returncode}"
            break
        if time.perf_counter() - t0 > timeout_s:
            result["error"] = f"not healthy in {timeout_s:.0f} s"
            break
        time.sleep(0.05)  # polling a process we do not control: nothing to wait on
    else:
        result["health_s"] = time.perf_counter() - t0
    ready_line = next((t for t, line in lines if "vision service ready" in line), None)
    result["ready_line_s"] = ready_line
    t_stop = time.perf_counter()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            result["error"] = result.get("error", "") + " (killed after 90 s of stopping)"
    result["stop_s"] = time.perf_counter() - t_stop
    result["exit"] = proc.returncode
    reader.join(timeout=5)
    log_path.write_text("".join(f"{t:7.2f}s {line}\n" for t, line in lines))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("extra", nargs="*", metavar="KEY=VALUE", help="more AppArgs fields for the launcher")
    p.add_argument("--model", default="/tmp/ckpt-7b", help="a checkpoint directory (or Hub id / preset)")
    p.add_argument("--export", default=None, help="first write this preset's weights to --model (a directory)")
    p.add_argument("--starts", type=int, default=4, help="fresh-process starts (the first reported apart)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds a start may take")
    p.add_argument("--log-dir", default="/tmp/cold_start", help="each start's timed launcher output")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    if a.export:
        from benchmarks.batch import export_preset

        t = time.perf_counter()
        export_preset(a.export, Path(a.model))
        print(f"exported {a.export} to {a.model} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    runs = []
    for i in range(a.starts):
        r = one_start(a.model, a.extra, logs / f"start_{i + 1}.log", a.timeout)
        runs.append(r)
        print(f"start {i + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)
    ok = [r["health_s"] for r in runs[1:] if "health_s" in r]
    lines = [
        "| start | ready line (s) | /health 200 (s) | stop (s) | exit |",
        "|---|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs):
        label = "first" if i == 0 else str(i + 1)
        health = f"{r['health_s']:.1f}" if "health_s" in r else r.get("error", "?")
        ready = f"{r['ready_line_s']:.1f}" if r.get("ready_line_s") is not None else "-"
        lines.append(f"| {label} | {ready} | {health} | {r['stop_s']:.1f} | {r['exit']} |")
    if ok:
        lines.append(f"\nmedian of starts 2-{a.starts}: {statistics.median(ok):.1f} s to /health 200")
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "extra": a.extra, "runs": runs}, indent=1))
    return 0 if len(ok) == a.starts - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
