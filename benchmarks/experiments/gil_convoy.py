"""GIL convoy between an encoder replica's device thread and its event loop (CPU; ratios only).

The replica's device thread mostly waits in calls that release the GIL (copies, graph replay, CUDA
syncs); its event loop meanwhile unpickles requests (150 KB arrays each) in Python. A thread coming back
from a GIL-releasing call waits until the GIL holder yields, which a busy thread does only every
`sys.getswitchinterval()` (5 ms by default), so every return can cost up to 5 ms. This times a stand-in
device step (4 GIL-releasing matmuls with a little Python between them) alone and beside a busy loop
thread, for several switch intervals. Run: python -m benchmarks.experiments.gil_convoy

Answer (2-core CPU box, 2026-11-29): beside a busy event-loop thread the device step is 6.0× slower at Python's 5 ms
switch interval, 2.2× at 1 ms and 1.8× at 0.5 ms; encoder replicas set 0.5 ms (`AppArgs.gil_switch_interval_s`).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import threading
import time

import numpy as np
import torch


def device_step(a: torch.Tensor) -> None:
    for _ in range(4):
        torch.mm(a, a)  # releases the GIL, like a CUDA copy or sync
        sum(range(2000))  # Python between device calls: needs the GIL back


def median_step_ms(a: torch.Tensor, payload: bytes, interval: float, busy_loop: bool, seconds: float) -> float:
    sys.setswitchinterval(interval)
    stop = threading.Event()

    def event_loop() -> None:
        while not stop.is_set():
            pickle.loads(payload)  # a request's arrays
            sum(range(20000))  # the rest of Serve's per-request Python

    thread = threading.Thread(target=event_loop, daemon=True)
    if busy_loop:
        thread.start()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        device_step(a)
        times.append(time.perf_counter() - t)
    stop.set()
    if busy_loop:
        thread.join()
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    payload = pickle.dumps([np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)])
    a = torch.randn(384, 384)
    default = sys.getswitchinterval()
    print("| switch interval | device step alone | beside a busy event loop | slowdown |")
    print("| ---: | ---: | ---: | ---: |")
    for interval in (0.005, 0.001, 0.0005):
        alone = median_step_ms(a, payload, interval, False, args.seconds)
        busy = median_step_ms(a, payload, interval, True, args.seconds)
        print(f"| {interval * 1e3:.1f} ms | {alone:.2f} ms | {busy:.2f} ms | {busy / alone:.2f}x |")
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
