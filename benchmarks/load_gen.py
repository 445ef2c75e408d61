"""Closed-loop load for the service benchmark (`benchmarks/service.py`): callers on Serve handles or HTTP
connections, in this process or spread over Ray actors, and the table row of a result (img/s, p50, p99)."""

from __future__ import annotations

import asyncio
import time


class Rejected(Exception):
    """An HTTP 429: the ingress's backpressure, as `OverCapacityError` is through a handle."""


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def run_load(kind: str, target, payloads: list, clients: int, duration: float, per_call: int = 1) -> dict:
    """Closed loop: `clients` callers, each sending payloads[i % len] until `duration` ends.

    kind "handle": target is an ingress DeploymentHandle, payload a list of uint8 arrays;
    kind "http": target a base URL, payload a JSON body. Returns images and per-call latencies.
    """
    from deployments.ingress.limits import OverCapacityError

    latencies: dict[int, list[float]] = {}
    count = rejected = 0
    session = None
    if kind == "http":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=clients)
        session = aiohttp.ClientSession(connector=connector, headers={"content-type": "application/json"})

    async def call(payload):
        if kind == "handle":
            await target.embed.remote(payload)
        else:
            async with session.post(f"{target}/v1/embeddings", data=payload) as r:
                if r.status == 429:
                    raise Rejected(await r.text())
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                await r.read()

    async def client(i: int, stop: float) -> None:
        nonlocal count, rejected
        k = i
        while time.perf_counter() < stop:
            payload = payloads[k % len(payloads)]
            t = time.perf_counter()
            try:
                await call(payload)
            except (OverCapacityError, Rejected):
                # the ingress's backpressure (its in-flight bytes at their limit): as a client told 429 does, wait a
                # moment and send again; not a completed call
                rejected += 1
                await asyncio.sleep(0.005)
                continue
            latencies.setdefault(k % len(payloads), []).append(time.perf_counter() - t)
            count += per_call
            k += clients

    try:
        await asyncio.gather(*(client(i, time.perf_counter() + min(1.0, duration / 4)) for i in range(clients)))  # warm
        latencies.clear()
        count, rejected, start = 0, 0, time.perf_counter()
        await asyncio.gather(*(client(i, start + duration) for i in range(clients)))
        elapsed = time.perf_counter() - start
    finally:
        if session is not None:
            await session.close()
    return {"images": count, "seconds": elapsed, "latencies": latencies, "rejected": rejected}


async def load(a, kind: str, target, payloads: list, clients: int, per_call: int = 1, app_name: str = "bench") -> dict:
    """Run the closed loop here, or split over `a.client_procs` Ray actors (the script's directory is on their
    path, so they import this module); merge their results. `a`: the benchmark's arguments (`client_procs`,
    `duration`)."""
    if a.client_procs <= 0 or clients < 2:
        return await run_load(kind, target, payloads, clients, a.duration, per_call)
    import ray

    @ray.remote(num_cpus=0)
    class Caller:
        async def run(self, kind, target, payloads, clients, duration, per_call):
            if kind == "handle":
                from ray import serve

                target = serve.get_app_handle(app_name)
            return await run_load(kind, target, payloads, clients, duration, per_call)

    procs = min(a.client_procs, clients)
    actors = [Caller.remote() for _ in range(procs)]
    tgt = target if kind == "http" else None
    parts = await asyncio.gather(*[c.run.remote(kind, tgt, payloads, clients // procs + (i < clients % procs),
                                                a.duration, per_call) for i, c in enumerate(actors)])  # fmt: skip
    merged = {"images": sum(p["images"] for p in parts), "seconds": max(p["seconds"] for p in parts), "latencies": {},
              "rejected": sum(p.get("rejected", 0) for p in parts)}  # fmt: skip
    for p in parts:
        for key, values in p["latencies"].items():
            merged["latencies"].setdefault(key, []).extend(values)
    for actor in actors:
        ray.kill(actor)
    return merged


def row(name: str, result: dict, keys=None) -> dict:
    """A table row; `keys` restricts latencies and img/s to those payload slots (one image per call)."""
    lat = [v for k, vs in result["latencies"].items() if keys is None or k in keys for v in vs]
    done = result["images"] if keys is None else len(lat)
    return {"phase": name, "img_s": done / result["seconds"], "p50_ms": pct(lat, 50) * 1e3,
            "p99_ms": pct(lat, 99) * 1e3, "calls": len(lat), "rejected": result.get("rejected", 0)}  # fmt: skip
