"""Service benchmark (one process, one device call): engine-only img/s, then the same 224x224 images
through Serve handles and over HTTP, and optionally the bucket router against Ray's default router.

Prints a markdown table (and writes JSON with --json). Phases:
  engine      GraphEncoder alone: resized uint8 224x224 images -> stack_patchify -> encode (mean),
              batches of 1 and of --engine-batch images, in this process.
  handle x1   --clients concurrent callers of `embed([one 224x224 uint8 array])` on the ingress handle.
  handle x32  --clients callers of `embed(32 arrays)`.
  http        --clients connections posting one 224x224 PNG data URL each to /v1/embeddings.
  http idle   one request at a time: latency at idle.
  router      (--router-compare) 2 replicas x 0.5 GPU, handle callers, 90% 224x224 / 10% 1344x1344:
              small-image latency and total img/s, Ray's default router vs deployments.routing.router:BucketRouter.

GPU (H200):  python -m benchmarks.service --model qwen2.5-vl-7b --replicas-per-gpu 2 --ingress-replicas 4
CPU check:   python -m benchmarks.service --model tiny --quick
The service as README command 1 starts it (`python -m deployments`, nothing exported; its own defaults):
  RAY_AUTH_MODE=token python -m benchmarks.service --model qwen2.5-vl-7b --launcher fast   (and --launcher default)
Ray's proxy alternatives are environment flags read when Serve starts, e.g.
  RAY_SERVE_ENABLE_HA_PROXY=1 python -m benchmarks.service ...   (or RAY_SERVE_ENABLE_DIRECT_INGRESS=1)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import io
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.load_gen import load, pct, row, run_load
from deployments.ray_compat import FAST_PATH_ENV  # imports Ray's core, not Serve: its flags are read later

# Ray Serve feature flags, read when Ray's processes start (set before `import ray`):
#   default     Ray's Python HTTP proxy; handle calls as Ray actor tasks; user code in a separate thread.
#   throughput  RAY_SERVE_THROUGHPUT_OPTIMIZED=1: handle calls over gRPC, user code and routers on the
#               replica's own event loop, ingress replicas listening themselves (a proxy stays on the head).
#   haproxy     throughput + RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy on the HTTP port balancing over the ingress
#               replicas' own listeners (no Python proxy hop).
# gRPC caps a replica's incoming message at 4 MiB; `embed` calls of 32 224x224 arrays are 4.8 MB, so the
# fast modes raise it. `haproxy` is the launcher's fast path (`deployments.ray_compat.FAST_PATH_ENV`).
# Direct ingress keeps a deleted app's ingress replicas draining for 30 s (for external load balancers);
# between the benchmark's deployments that is only waiting.
_DRAIN = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
SERVE_MODES = {
    "default": {},
    "throughput": {k: v for k, v in FAST_PATH_ENV.items() if k != "RAY_SERVE_ENABLE_HA_PROXY"} | _DRAIN,
    "haproxy": FAST_PATH_ENV | _DRAIN,
}


SKIPPABLE = {"engine", "handle", "http", "idle"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-vl-7b")
    p.add_argument("--dtype", default=None)
    p.add_argument("--attention", default=None)
    p.add_argument("--buckets", default=None)
    p.add_argument("--replicas-per-gpu", type=int, default=1, help="encoder replicas sharing each GPU")
    p.add_argument("--replicas", type=int, default=None, help="encoder replicas on CPU (default 1)")
    p.add_argument("--ingress-replicas", type=int, default=2)
    p.add_argument("--ingress-batch-size", type=int, default=32, help="0: no ingress batching")
    p.add_argument("--ingress-slots", type=int, default=2, help="merged encoder requests in flight per ingress")
    p.add_argument("--batcher", default="continuous", choices=["serve", "continuous"])
    p.add_argument("--pipeline-depth", type=int, default=None, help="batches in flight per encoder replica")
    p.add_argument("--gil-switch-interval", type=float, default=None, help="seconds, in encoder and ingress replicas")
    p.add_argument("--batch-wait", type=float, default=0.002)
    p.add_argument("--router", default=None, help="request router import path for the main phases")
    p.add_argument("--router-compare", action="store_true", help="add the mixed-load router comparison")
    p.add_argument("--serve-mode", default="haproxy", choices=sorted(SERVE_MODES), help="Ray Serve's request path")
    p.add_argument(
        "--launcher", default=None, choices=["fast", "default"],
        help="serve through `python -m deployments --request-path X model=--model` in a subprocess started with none "
        "of Serve's variables exported (its defaults for everything else) instead of serve.run in this process",
    )  # fmt: skip
    p.add_argument("--launcher-log", default="/tmp/launcher.log", help="the launcher's output (--launcher)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--client-procs", type=int, default=0, help="spread callers over N Ray actors (0: this process)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measured phase")
    p.add_argument("--engine-batch", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="short phases, few clients (a CPU smoke run)")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--skip", default="", help=f"phase groups to leave out (comma list): {', '.join(sorted(SKIPPABLE))}")
    p.add_argument(
        "--http-variants", default="",
        help="extra HTTP phases after the pooled one, comma list of pooling-format[-dtype], e.g. "
        "none-base64-bfloat16,none-base64-float32,none-float (per-token answers)",
    )  # fmt: skip
    a = p.parse_args()
    if a.quick:
        a.duration, a.clients, a.engine_batch = 2.0, min(a.clients, 8), min(a.engine_batch, 8)
    a.skip = set(filter(None, a.skip.split(",")))
    if a.skip - SKIPPABLE:
        p.error(f"--skip: unknown phase groups {sorted(a.skip - SKIPPABLE)}")
    return a


def images(side: int, n: int, pp, seed: int = 0) -> list[np.ndarray]:
    from encoder.preprocessing.images import load_image
    from encoder.preprocessing.qwen import resize_image

    rng = np.random.default_rng(seed)
    return [resize_image(load_image(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)), pp) for _ in range(n)]


def png_body(img: np.ndarray, **fields) -> bytes:
    """A POST /v1/embeddings body with one PNG data URL; `fields` add request fields (pooling, ...)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return json.dumps({"input": [url], **fields}).encode()


def http_variant(spec: str) -> dict:
    """ "none-base64-bfloat16" -> request fields pooling / encoding_format / embedding_dtype."""
    pooling, fmt, dtype = (spec.split("-") + ["", ""])[:3]
    fields = {"pooling": pooling, "encoding_format": fmt or "float"}
    return fields | ({"embedding_dtype": dtype} if dtype else {})


# ------------------------------------------------------------------------------------------ engine


def engine_phase(a, device: str) -> list[dict]:
    import encoder
    from deployments.config import AppArgs, replica_plan
    from encoder.patchify import stack_patchify
    from workspace import GraphEncoder

    vision = encoder.load(a.model, device=device, dtype=a.dtype, attention=a.attention)
    eng = GraphEncoder(vision, replica_plan(AppArgs(buckets=a.buckets), vision, device).table)
    imgs = images(224, a.engine_batch, vision.preprocess_config)
    rows = []

    def run_phase(name: str, n: int, step) -> None:
        for _ in range(3):
            step()
        times, deadline = [], time.perf_counter() + min(a.duration, 5)
        while time.perf_counter() < deadline or len(times) < 3:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        rows.append({"phase": name, "img_s": n / med, "p50_ms": med * 1e3, "p99_ms": pct(times, 99) * 1e3})

    pp, dev = vision.preprocess_config, vision.device
    for n in sorted({1, 16, a.engine_batch}):
        run_phase(f"engine x{n}", n, lambda b=imgs[:n]: eng.encode(stack_patchify(b, pp, dev), pooling="mean"))
    # as a replica with pipeline_depth 2 runs: batch N+1 prepared and queued while batch N replays
    # (one step = one batch: launch the next, then wait for the oldest)
    for n in sorted({16, a.engine_batch}):
        inflight: list = []

        def step(b=imgs[:n], inflight=inflight):
            inflight.append(eng.encode_async(stack_patchify(b, pp, dev), pooling="mean"))
            if len(inflight) > 1:
                inflight.pop(0).result()

        run_phase(f"engine x{n}, 2 in flight", n, step)
    return rows


# ------------------------------------------------------------------------------------------ service


def app_args(a, gpus: int, **over) -> dict:
    per_gpu = max(1, a.replicas_per_gpu)
    args = {
        "model": a.model, "dtype": a.dtype, "attention": a.attention, "buckets": a.buckets,
        "num_replicas": per_gpu * gpus if gpus else (a.replicas or 1),
        "num_gpus": 1 / per_gpu if gpus else 0, "num_cpus": 0.5,
        "batcher": a.batcher, "batch_wait_timeout_s": a.batch_wait, "pipeline_depth": a.pipeline_depth,
        "gil_switch_interval_s": a.gil_switch_interval,
        "ingress_replicas": a.ingress_replicas, "ingress_batch_size": a.ingress_batch_size,
        "ingress_max_concurrent_batches": a.ingress_slots, "request_router_class": a.router,
    }  # fmt: skip
    args.update(over)
    return {k: v for k, v in args.items() if v is not None}


def deploy(args: dict):
    from ray import serve

    import deployments

    t = time.perf_counter()
    serve.run(deployments.build_app(args), name="bench", route_prefix="/")
    print(f"deployed in {time.perf_counter() - t:.1f}s: {json.dumps(args)}", file=sys.stderr, flush=True)
    return serve.get_app_handle("bench")


async def replica_stats(method, calls: int = 24) -> dict[str, dict]:
    """{replica id: stats} of the replicas that answered `calls` stats calls (the router spreads them)."""
    answers = await asyncio.gather(*(method.remote() for _ in range(calls)))
    return {s["replica_id"]: s for s in answers}


async def encoder_report(before: dict[str, dict], label: str) -> None:
    """Print what each encoder replica did since `before`: batches, mean images per batch, busy share."""
    from ray import serve

    enc = serve.get_deployment_handle("VisionEncoder", "bench")
    after = await replica_stats(enc.stats)
    for rid, s in sorted(after.items()):
        b = before.get(rid, {})
        batches = s["batches"] - b.get("batches", 0)
        images = s["batched_images"] - b.get("batched_images", 0)
        requests = s["batched_requests"] - b.get("batched_requests", 0)
        busy = s["busy_seconds"] - b.get("busy_seconds", 0.0)
        launch = s["launch_seconds"] - b.get("launch_seconds", 0.0)
        print(f"  [{label}] encoder {rid}: {batches} batches, {requests} requests, {images} images "
              f"({images / max(batches, 1):.1f}/batch), batches in flight {busy:.1f}s, device thread {launch:.1f}s, "
              f"depth {s['pipeline_depth']}, last {s['timings_ms']}", file=sys.stderr, flush=True)  # fmt: skip


async def mid_phase_timings(label: str, delay: float) -> None:
    """After `delay` seconds (inside a measured phase): the medians of the last requests' phases in every
    ingress replica (HTTP / handle phases, each encoder call's round trip) and in the encoder replicas."""
    from ray import serve

    await asyncio.sleep(delay)
    ingress = await replica_stats(serve.get_app_handle("bench").ingress_stats, 24)
    encoders = await replica_stats(serve.get_deployment_handle("VisionEncoder", "bench").stats, 8)
    for rid, stats in sorted(ingress.items()):
        print(f"  [{label}] mid-phase ingress {rid}: {stats['timings_ms']}", file=sys.stderr, flush=True)
    for rid, stats in sorted(encoders.items()):
        print(f"  [{label}] mid-phase encoder {rid}: {stats['timings_ms']}", file=sys.stderr, flush=True)


async def measured(a, name: str, kind: str, target, payloads, clients: int, per_call: int = 1) -> dict:
    from ray import serve

    before = await replica_stats(serve.get_deployment_handle("VisionEncoder", "bench").stats)
    print(f"phase {name} start", file=sys.stderr, flush=True)  # profilers started beside this wait for it
    # warm-up (up to 1 s), then the measured part: sample its middle
    sample = asyncio.ensure_future(mid_phase_timings(name, min(1.0, a.duration / 4) + a.duration / 2))
    result = await load(a, kind, target, payloads, clients, per_call)
    await sample
    await encoder_report(before, name)
    return result


async def timed(name: str, call, seconds: float = 2.0) -> dict:
    """One caller, calls back to back for `seconds` (after 5 unmeasured): a row of idle latencies."""
    for _ in range(5):
        await call()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t)
    return {"phase": name, "img_s": len(times) / seconds, "p50_ms": pct(times, 50) * 1e3,
            "p99_ms": pct(times, 99) * 1e3, "calls": len(times)}  # fmt: skip


async def idle_breakdown(handle, base_url: str, img: np.ndarray, body: bytes) -> list[dict]:
    """Where an idle request's time goes: one Serve hop, the encoder replica, the ingress, HTTP."""
    import aiohttp
    from ray import serve

    enc = serve.get_deployment_handle("VisionEncoder", "bench")
    n = (img.shape[0] // 14) * (img.shape[1] // 14)
    png = json.loads(body)["input"][0]
    b64_body = json.dumps({"input": [png], "encoding_format": "base64"}).encode()
    rows = [
        await timed("idle: encoder describe (1 hop, no work)", lambda: enc.describe.remote()),
        await timed(
            "idle: encoder encode_pixels (1 hop + replica)",
            lambda: enc.encode_pixels.remote([img], pooling="mean", num_patches=n),
        ),  # fmt: skip
        await timed("idle: embed uint8 (2 hops)", lambda: handle.embed.remote([img])),
        await timed("idle: embed PNG data URL (2 hops + decode)", lambda: handle.embed.remote([png])),
    ]
    async with aiohttp.ClientSession(headers={"content-type": "application/json"}) as session:

        async def get_models():
            async with session.get(f"{base_url}/v1/models") as r:
                await r.read()

        async def post_b64():
            async with session.post(f"{base_url}/v1/embeddings", data=b64_body) as r:
                assert r.status == 200, r.status
                await r.read()

        rows.append(await timed("idle: HTTP GET /v1/models (no encoder)", get_models))
        rows.append(await timed("idle: HTTP POST PNG, base64 answer", post_b64))
    # server-side medians of those last idle HTTP requests: ingress phases, encoder replica phases
    for rid, stats in sorted((await replica_stats(handle.ingress_stats, 24)).items()):
        print(f"  idle timings, ingress {rid}: {stats['timings_ms']}", file=sys.stderr, flush=True)
    for rid, stats in sorted((await replica_stats(enc.stats, 8)).items()):
        print(f"  idle timings, encoder {rid}: {stats['timings_ms']}", file=sys.stderr, flush=True)
    return rows


async def service_phases(a, gpus: int, base_url: str) -> list[dict]:
    from ray import serve

    from encoder.preprocessing.qwen import PreprocessConfig

    handle = serve.get_app_handle("bench") if a.launcher else deploy(app_args(a, gpus))
    pp_dict = (await handle.info.remote())["preprocess"]
    imgs = images(224, 64, PreprocessConfig.model_validate(pp_dict), seed=1)
    rows = []
    if "handle" not in a.skip:
        rows.append(row("handle x1", await measured(a, "handle x1", "handle", handle, [[x] for x in imgs], a.clients)))
        batches = [imgs[:32], imgs[32:]]
        rows.append(
            row("handle x32", await measured(a, "handle x32", "handle", handle, batches, a.clients, per_call=32))
        )
    bodies = [png_body(x) for x in imgs]
    if "http" not in a.skip:
        rows.append(row("http", await measured(a, "http", "http", base_url, bodies, a.clients)))
    for spec in filter(None, a.http_variants.split(",")):
        variant = [png_body(x, **http_variant(spec)) for x in imgs]
        rows.append(row(f"http {spec}", await measured(a, f"http {spec}", "http", base_url, variant, a.clients)))
    if "idle" not in a.skip:
        idle = await run_load("http", base_url, bodies, 1, min(a.duration, 5))
        rows.append(row("http idle (1 conn)", idle))
        idle = await run_load("handle", handle, [[x] for x in imgs], 1, min(a.duration, 5))
        rows.append(row("handle idle (1 caller)", idle))
        rows += await idle_breakdown(handle, base_url, imgs[0], bodies[0])
    for rid, stats in sorted((await replica_stats(handle.ingress_stats, 4 * a.ingress_replicas)).items()):
        print(f"  ingress replica {rid}: {stats}", file=sys.stderr)
    if not a.launcher:  # the launcher's application goes when the launcher stops
        serve.delete("bench")
    return rows


async def router_phases(a, gpus: int) -> list[dict]:
    from ray import serve

    from encoder.preprocessing.qwen import PreprocessConfig

    rows = []
    for router in (None, "deployments.routing.router:BucketRouter"):
        over = {"num_replicas": 2, "num_gpus": 0.5 if gpus else 0, "request_router_class": router or "ray",
                "ingress_batch_size": 0}  # fmt: skip
        handle = deploy(app_args(a, gpus, **over))
        pp = PreprocessConfig.model_validate((await handle.info.remote())["preprocess"])
        small, large = images(224, 9, pp, seed=2), images(1344, 1, pp, seed=3)
        payloads = [[x] for x in small] + [[x] for x in large]  # 10 slots: 90% small, 10% large
        name = router.rsplit(":", 1)[-1] if router else "default router"
        result = await measured(a, f"mixed, {name}", "handle", handle, payloads, a.clients)
        rows.append(row(f"mixed, {name}: 224x224", result, keys=set(range(9))))
        rows.append(row(f"mixed, {name}: 1344x1344", result, keys={9}))
        rows.append(row(f"mixed, {name}: all", result))
        serve.delete("bench")
    return rows


async def serve_phases(a, gpus: int, base_url: str) -> list[dict]:
    from ray import serve

    if a.launcher:
        return await service_phases(a, gpus, base_url)
    try:
        rows = await service_phases(a, gpus, base_url)
        if a.router_compare:
            rows += await router_phases(a, gpus)
    finally:
        serve.shutdown()  # inside the loop that owns this process's handles
    return rows


def start_launcher(a, port: int):
    """`python -m deployments` as a newcomer runs it: none of Serve's variables in its environment, no cluster
    address; returns the process once /health answers 200 (its output in --launcher-log)."""
    import subprocess
    import urllib.request

    from deployments.ray_compat import FAST_PATH_ENV, LAUNCHER_ENV

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {*FAST_PATH_ENV, *LAUNCHER_ENV, *_DRAIN, "RAY_ADDRESS", "RAY_AUTH_MODE"}
    }
    cmd = [sys.executable, "-m", "deployments", "--port", str(port), "--name", "bench",
           "--request-path", a.launcher, f"model={a.model}"]  # fmt: skip
    cmd += [f"{k}={v}" for k, v in (("dtype", a.dtype), ("attention", a.attention), ("buckets", a.buckets)) if v]
    t = time.perf_counter()
    log = open(a.launcher_log, "w")  # noqa: SIM115 (the child writes it until it stops)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the launcher exited with {proc.returncode}: see {a.launcher_log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.perf_counter() - t > 600:
            proc.kill()
            raise SystemExit(f"the launcher was not ready in 600 s: see {a.launcher_log}")
        time.sleep(0.5)  # polling a process we do not control: nothing to wait on
    print(f"launcher ({a.launcher} path) ready in {time.perf_counter() - t:.1f}s: {' '.join(cmd)}", file=sys.stderr)
    return proc


def launcher_ray_address(pid: int) -> str:
    """The GCS address of the Ray instance the launcher (process `pid`) started: Ray names a session directory
    after the process that started it (this machine may run other Ray instances, so not `address="auto"`)."""
    import glob

    for session in sorted(glob.glob(f"/tmp/ray/session_*_{pid}")):
        for port_file in glob.glob(f"{session}/gcs_server_port_*"):  # the launcher's Ray is on this machine
            return f"127.0.0.1:{Path(port_file).read_text().strip()}"
    raise SystemExit(f"no Ray session of process {pid} under /tmp/ray")


def stop_launcher(proc) -> None:
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)  # its graceful stop: drain, then Serve and Ray
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_async(coro):
    """The driver's event loop: uvloop when installed, as in Ray's worker processes (the caller actors, the
    replicas), so the idle rows measured from here pay what a client on a fast loop pays."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> None:
    a = parse_args()
    if a.launcher:  # this driver's handles use the path the launcher's Ray runs (set before `import ray`)
        a.serve_mode = "haproxy" if a.launcher == "fast" else "default"
        a.router_compare = False
        if os.environ.get("RAY_AUTH_MODE") != "token":  # read when Ray's core is imported, above
            raise SystemExit(
                "--launcher joins the launcher's Ray, which keeps token authentication on: run with RAY_AUTH_MODE=token"
            )
    os.environ.update(SERVE_MODES[a.serve_mode])
    import ray
    import torch
    from ray import serve

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count()
    rows = engine_phase(a, device) if "engine" not in a.skip else []
    gc.collect()  # the engine's graphs and pool go before the replicas capture theirs
    if gpus:
        torch.cuda.empty_cache()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = start_launcher(a, port) if a.launcher else None
    try:
        if launcher is not None:
            from deployments.ray_compat import loopback_only_node

            loopback_only_node()  # the launcher's Ray (on --host 127.0.0.1) is on loopback only: join it there
            ray.init(address=launcher_ray_address(launcher.pid), namespace="serve")
        else:
            ray.init(num_cpus=max(8, os.cpu_count() or 1) if not gpus else None, include_dashboard=False)
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        rows += run_async(serve_phases(a, gpus, f"http://127.0.0.1:{port}"))
    finally:
        ray.shutdown()
        if launcher is not None:
            stop_launcher(launcher)
    engine = max((r["img_s"] for r in rows if r["phase"].startswith("engine")), default=float("nan"))
    print(f"\nmodel {a.model} on {torch.cuda.get_device_name() if gpus else 'CPU'}; {a.clients} clients, "
          f"{a.duration:g}s per phase; replicas/GPU {a.replicas_per_gpu}, ingress replicas {a.ingress_replicas}, "
          f"ingress batch {a.ingress_batch_size}, batcher {a.batcher}, pipeline depth {a.pipeline_depth or 'default'}, "
          f"serve mode {a.serve_mode}{' (launcher)' if a.launcher else ''}\n")  # fmt: skip
    print("| phase | img/s | p50 ms | p99 ms | % of engine |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        share = 100 * r["img_s"] / engine
        phase = r["phase"] + (f" ({r['rejected']} sent again after a 429)" if r.get("rejected") else "")
        print(f"| {phase} | {r['img_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {share:.0f}% |")
    if a.json:
        args = vars(a) | {"skip": sorted(a.skip)}  # a set: not JSON
        Path(a.json).write_text(json.dumps({"args": args, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
