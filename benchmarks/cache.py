"""Encoder cache benchmark (issue 47 item 3): a repeated-request workload through the running service, uncached
(`cache_mib=0`) then cached, on whatever device the replica gets (a CPU by default, the `tiny` model).

The workload: `--distinct` different images (random pixels, `--side` square, PNG data URLs), `--clients` HTTP
connections each posting one image per request round-robin over them for `--duration` seconds (after a warm-up
second), as chats that re-send their images do. Before the load and after it each service is sent every distinct
image once, one request at a time (cached: the first pass is the misses, stored; the second the hits): all four
answers of an image must be byte-identical (the same JSON body, base64 float32). And the cached ingress replica's
cache must hold at most `cache_mib`.

Prints a markdown table (req/s, p50, p99 per mode, the speed-up) and writes JSON with --json. Exit status 1 when
an answer differs or the cache is over its bound; the speed-up is reported, not asserted.

CPU:    python -m benchmarks.cache                     (tiny, 448x448, 8 images, 4 connections, 10 s a mode)
Smoke:  python -m benchmarks.cache --smoke             (a few seconds; what tests/integration/serve runs)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import os
import platform
import socket
import sys
import time

import numpy as np

from benchmarks.load_gen import row, run_load


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--side", type=int, default=448, help="image side in pixels (PNG of random pixels)")
    p.add_argument("--distinct", type=int, default=8, help="different images the requests cycle over")
    p.add_argument("--clients", type=int, default=4, help="concurrent HTTP connections")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per mode")
    p.add_argument("--cache-mib", type=int, default=64, help="the cached service's cache_mib")
    p.add_argument("--pooling", default=None, help="the requests' pooling (default: the model's)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and short runs: a check that it works")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    if a.smoke:
        a.side, a.distinct, a.clients, a.duration = 64, 2, 2, 1.0
    return a


def png_bodies(a) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    bodies = []
    for _ in range(a.distinct):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (a.side, a.side, 3), dtype=np.uint8)).save(buf, format="PNG")
        body = {
            "input": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(),
            "encoding_format": "base64",
        }
        if a.pooling:
            body["pooling"] = a.pooling
        bodies.append(json.dumps(body).encode())
    return bodies


def app_args(a, cache_mib: int) -> dict:
    return {"model": a.model, "device": a.device, "num_replicas": 1, "num_cpus": 0.5, "num_gpus": 0 if a.device ==
            "cpu" else 1, "ingress_replicas": 1, "cache_mib": cache_mib, "max_request_images": 8}  # fmt: skip


async def answers(base_url: str, bodies: list[bytes]) -> list[bytes]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession(headers={"content-type": "application/json"}) as session:
        for body in bodies:
            async with session.post(f"{base_url}/v1/embeddings", data=body) as r:
                out.append(await r.read() if r.status == 200 else f"HTTP {r.status}".encode())
    return out


def measure(a, base_url: str, name: str, cache_mib: int, bodies: list[bytes]) -> tuple[dict, list[bytes], dict]:
    """Deploy the service as `name` with `cache_mib`; one answer per image, one request at a time; the load; the
    answers again (cached: hits), which must be the same bytes (else none are returned); the ingress's stats; then
    delete it."""
    from ray import serve

    import deployments

    handle = serve.run(deployments.build_app(app_args(a, cache_mib)), name=name, route_prefix=f"/{name}")
    url = f"{base_url}/{name}"
    try:
        first = asyncio.run(answers(url, bodies))  # one at a time: cached, these are the misses stored
        result = asyncio.run(run_load("http", url, bodies, a.clients, a.duration))
        again = asyncio.run(answers(url, bodies))  # cached, hits
        stats = handle.ingress_stats.remote().result()
    finally:
        serve.delete(name)
    if again != first:
        print(f"{name}: the answers after the load differ from the first ones", file=sys.stderr)
        first = []
    return row(name, result), first, stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None, base_url: str | None = None) -> int:
    """`base_url`: a running Serve's HTTP address (tests); None: start Ray and Serve here and stop them after."""
    a = parse_args(argv)
    import ray
    from ray import serve

    started = False
    if base_url is None:
        port = free_port()
        ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)  # fmt: skip
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base_url, started = f"http://127.0.0.1:{port}", True
    bodies = png_bodies(a)
    try:
        plain, plain_answers, _ = measure(a, base_url, "uncached", 0, bodies)
        cached, cached_answers, stats = measure(a, base_url, "cached", a.cache_mib, bodies)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
    identical = plain_answers == cached_answers and all(x.startswith(b"{") for x in plain_answers)
    held = stats["cache"]
    within = held is not None and held["bytes"] <= a.cache_mib * 2**20
    speedup = cached["img_s"] / plain["img_s"]
    workload = f"{a.model} on {a.device}, {a.distinct} distinct {a.side}x{a.side} PNGs, {a.clients} HTTP connections"
    print(f"\n{workload}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| mode | req/s | p50 ms | p99 ms | requests |")
    print("| --- | --- | --- | --- | --- |")
    for r in (plain, cached):
        print(f"| {r['phase']} | {r['img_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['calls']} |")
    print(f"\nspeed-up {speedup:.1f}x; answers byte-identical: {identical}; cache {held} (bound {a.cache_mib} MiB); "
          f"hits {stats['cache_hits']}, misses {stats['cache_misses']}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": workload, "rows": [plain, cached], "speedup": speedup, "identical": identical,
                       "cache": held, "hits": stats["cache_hits"], "misses": stats["cache_misses"],
                       "time": time.strftime("%Y-%m-%d")}, f, indent=2)  # fmt: skip
    if not identical:
        print("answers differ between the cached and the uncached service", file=sys.stderr)
    if not within:
        print(f"the cache holds {held} bytes, over cache_mib", file=sys.stderr)
    return 0 if identical and within else 1


if __name__ == "__main__":
    sys.exit(main())
