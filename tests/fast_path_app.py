"""Run by `test_serve_fast_path.py` in a process of its own (Ray Serve's feature flags are read when Ray's
processes start): deploys the app on a fresh local Ray instance and prints what it answered, as JSON."""

from __future__ import annotations

import base64
import io
import json
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before ray.init: Ray workers inherit the driver's sys.path

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from PIL import Image  # noqa: E402
from ray import serve  # noqa: E402

import deployments  # noqa: E402
import encoder  # noqa: E402


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(deployments.build_app({"model": "tiny", "num_replicas": 2}), name="vision", route_prefix="/")
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
        ),
        flush=True,
    )
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
