"""Run by `test_serve_fast_path.py` in a process of its own (Ray Serve's feature flags are read when Ray's
processes start): deploys the app on a fresh local Ray instance and prints what it answered, as JSON."""

from __future__ import annotations

import base64
import io
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # before ray.init: Ray workers inherit the driver's sys.path

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from PIL import Image  # noqa: E402
from ray import serve  # noqa: E402

import deployments  # noqa: E402
import encoder  # noqa: E402
from tests.serve_fixtures import free_port, make_switch, wait_for  # noqa: E402


def kill_under_load(handle, base: str, url: str, expected: np.ndarray) -> dict:
    """8 HTTP clients in a closed loop; a batch is held inside one encoder replica, which is then killed:
    every request must still be answered, and right (the ingress retries on the other replica)."""
    results: list[bool] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(f"{base}/v1/embeddings", json={"input": [url]})
                ok = r.status_code == 200 and np.allclose(r.json()["data"][0]["embedding"], expected, atol=1e-4)
                results.append(ok)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    switch = make_switch()
    try:
        wait_for(lambda: len(results) >= 16, 120, what="the closed loop to warm up")
        encoder_handle = serve.get_deployment_handle("VisionEncoder", "vision")
        retries = sum(s["encoder_retries"] for s in ingress_stats(handle))
        victim = encoder_handle.inject_fault.remote("hold", switch=switch).result(timeout_s=60)
        wait_for(lambda: ray.get(switch.waiters.remote()) >= 1, 60, what="a batch held in the victim")
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        at_kill = len(results)
        wait_for(lambda: len(results) >= at_kill + 48, 120, what="requests after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        ray.get(switch.release.remote())
    return {
        "kill_requests": len(results),
        "kill_failures": results.count(False),
        "kill_retries": sum(s["encoder_retries"] for s in ingress_stats(handle)) - retries,
    }


def ingress_stats(handle) -> list[dict]:
    return [handle.ingress_stats.remote().result(timeout_s=60)]  # one ingress replica


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": "tiny", "num_replicas": 2, "enable_fault_injection": True, "encoder_retries": 5,
            "health_check_period_s": 0.5, "ingress_batch_size": 0}  # fmt: skip
    handle = serve.run(deployments.build_app(args), name="vision", route_prefix="/")
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(32)]  # 4.8 MB in one call
    got = handle.embed.remote(images).result(timeout_s=300)
    want = encoder.load("tiny").encode(images, pooling="mean")
    buf = io.BytesIO()
    Image.fromarray(images[0]).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    base = f"http://127.0.0.1:{port}"
    ok = httpx.post(f"{base}/v1/embeddings", json={"input": [url]}, timeout=120)
    bad = httpx.post(f"{base}/v1/embeddings", json={"input": ["not base64 at all!"]}, timeout=120)
    kill = kill_under_load(handle, base, url, want[0].numpy())
    print(
        "RESULT",
        json.dumps(
            {
                "handle_max_abs_diff": float(max(np.abs(g - w.numpy()).max() for g, w in zip(got, want, strict=True))),
                "handle_count": len(got),
                "http_status": ok.status_code,
                "http_max_abs_diff": float(np.abs(np.array(ok.json()["data"][0]["embedding"]) - got[0]).max()),
                "bad_status": bad.status_code,
                "bad_code": bad.json()["error"]["code"],
            }
            | kill
        ),
        flush=True,
    )
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
