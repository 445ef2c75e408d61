"""The drain itself, on the shared Ray instance (issue 17, item 5; `deployments.shutdown.drain`).

What `python -m deployments.shutdown` and `serve run`'s signal handler do before Serve's shutdown: with one
request held in the encoder, `drain()` waits for it (it is answered 200), `/health` turns 503 `draining`,
and new HTTP and handle requests are refused with 503 and Retry-After (`shutting_down`, `BackPressureError`).
"""

from __future__ import annotations

import base64
import threading

import httpx
import pytest
import ray
from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.config import ENCODER_NAME
from deployments.shutdown import drain, release
from tests.images_util import encode, random_image
from tests.serve_fixtures import app_fixture, make_switch, wait_for

pytestmark = pytest.mark.slow

# no grace (`drain_grace_s`): admission ends when /health turns 503, so the first request after it is refused (the
# grace itself, which admits requests on their way, is tests/unit/deployments/test_shutdown_health_units.py's)
ARGS = {"model": "tiny", "enable_fault_injection": True, "ingress_batch_size": 0, "drain_grace_s": 0}
app = app_fixture(ARGS, "drain")
PNG = encode(random_image("RGB", 48, 48), "PNG")
BODY = {"input": ["data:image/png;base64," + base64.b64encode(PNG).decode()]}


def test_drain_waits_for_admitted_work_then_refuses(app):
    assert httpx.post(f"{app.base_url}/v1/embeddings", json=BODY, timeout=60).status_code == 200
    switch = make_switch()
    encoder = serve.get_deployment_handle(ENCODER_NAME, app_name=app.name)
    encoder.inject_fault.remote("hold", switch, 120).result()
    held: list[int] = []
    request = threading.Thread(
        target=lambda: held.append(httpx.post(f"{app.base_url}/v1/embeddings", json=BODY, timeout=120).status_code)
    )
    request.start()
    wait_for(lambda: ray.get(switch.waiters.remote()) >= 1, timeout_s=60, what="the request held in the encoder")
    result: list[bool] = []
    draining = threading.Thread(target=lambda: result.append(drain(timeout_s=120)))
    draining.start()
    try:
        wait_for(
            lambda: httpx.get(f"{app.base_url}/health", timeout=10).json()["status"] == "draining",
            timeout_s=30,
            what="/health draining",
        )
        assert httpx.get(f"{app.base_url}/health", timeout=10).status_code == 503

        # admitted (the default grace of 5 s), it would wait behind the hold until httpx's time limit
        r = httpx.post(f"{app.base_url}/v1/embeddings", json=BODY, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert "retry-after" in r.headers
        with pytest.raises(BackPressureError, match="shutting down") as refusal:
            app.handle.embed.remote([PNG]).result()
        assert refusal.value.status_code == 503 and refusal.value.retry_after_s is not None
        assert draining.is_alive() and not result  # the held request is still in flight: not drained
        ray.get(switch.release.remote())
        request.join(timeout=120)
        draining.join(timeout=120)
        assert held[0] == 200 and result == [True]
    finally:
        ray.get(switch.release.remote())
        release()
