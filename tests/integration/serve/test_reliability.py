"""Replica death and health on CPU Ray (issue 6, acceptance 2 and 5).

Two encoder replicas behind one ingress. A closed loop of 16 HTTP clients runs while one replica,
caught with requests inside it (held by a fault-injection hook), is killed with `ray.kill`: the
ingress retries the dead replica's encoder calls on the other one, so no client sees a failure, and
Serve starts a replacement. Then a replica whose weights are corrupted fails its health probe (a real
encode through the graph path) and Serve replaces it.
"""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import pytest
import ray
from ray import serve

from deployments.config import ENCODER_NAME
from tests.images_util import two_bucket_images
from tests.serve_fixtures import app_fixture, make_switch

pytestmark = pytest.mark.slow

APP = "reliability"
ARGS = {
    "model": "tiny",
    "num_replicas": 2,
    "enable_fault_injection": True,
    "health_check_period_s": 0.5,
    "health_check_timeout_s": 10,
    "encoder_retries": 5,
    "graceful_shutdown_timeout_s": 10,
    # One image per encoder request, so the bucket router sends the two sizes below to different
    # replicas (each owns one bucket) and both replicas have traffic to be caught holding.
    "ingress_batch_size": 0,
}
ATOL = 1e-4


def replica_names() -> set[str]:
    prefix = f"SERVE_REPLICA::{APP}#{ENCODER_NAME}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def running_encoders() -> int:
    app = serve.status().applications.get(APP)
    return app.deployments[ENCODER_NAME].replica_states.get("RUNNING", 0) if app else 0


app = app_fixture(ARGS, APP)


@pytest.fixture(scope="module")
def encoder_handle(app):
    return serve.get_deployment_handle(ENCODER_NAME, app_name=APP)


@pytest.fixture(scope="module")
def images():
    """A small (bucket 256) and a large (bucket 1024) image with their expected embeddings."""
    return two_bucket_images()


def post(client: httpx.Client, data: bytes) -> httpx.Response:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return client.post("/v1/embeddings", json={"input": [url]})


def test_killing_a_replica_loses_no_request(app, encoder_handle, images):
    from tests.serve_fixtures import wait_for

    before = replica_names()
    assert len(before) == 2
    results: list[tuple[int, bool, str]] = []
    stop = threading.Event()

    def client_loop(k: int) -> None:
        data, expected = images[k % 2]
        with httpx.Client(base_url=app.base_url, timeout=60) as c:
            while not stop.is_set():
                try:
                    r = post(c, data)
                    ok = r.status_code == 200 and np.allclose(r.json()["data"][0]["embedding"], expected, atol=ATOL)
                    results.append((r.status_code, ok, "" if ok else r.text[:300]))
                except httpx.HTTPError as e:
                    results.append((0, False, repr(e)))

    clients = [threading.Thread(target=client_loop, args=(k,), daemon=True) for k in range(16)]
    for t in clients:
        t.start()
    switch = make_switch()
    try:
        wait_for(lambda: len(results) >= 32, timeout_s=60, what="the closed loop to warm up")
        # Catch one replica with requests inside it, then kill it.
        victim = encoder_handle.inject_fault.remote("hold", switch=switch).result(timeout_s=30)
        wait_for(lambda: ray.get(switch.waiters.remote()) >= 1, timeout_s=30, what="a batch held in the victim")
        retries_before = app.handle.ingress_stats.remote().result(timeout_s=30)["encoder_retries"]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        at_kill = len(results)
        wait_for(lambda: len(results) >= at_kill + 96, timeout_s=90, what="requests after the kill")
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=90)
        ray.get(switch.release.remote())
    failures = [r for r in results if not r[1]]
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:3]}"
    stats = app.handle.ingress_stats.remote().result(timeout_s=30)
    assert stats["encoder_retries"] > retries_before, stats  # the killed replica had calls in flight
    # Serve replaces the replica; it serves only once its constructor (graph capture) returned.
    wait_for(
        lambda: running_encoders() == 2 and len(replica_names() - before) == 1 and victim not in replica_names(),
        timeout_s=90,
        what="the replacement replica",
    )
    ids = {encoder_handle.describe.remote().result(timeout_s=30)["replica_id"] for _ in range(8)}
    assert victim.rsplit("#", 1)[1] not in ids
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        for data, expected in images:
            np.testing.assert_allclose(post(c, data).json()["data"][0]["embedding"], expected, atol=ATOL)


def test_failed_health_check_replaces_the_replica(app, encoder_handle, images):
    from tests.serve_fixtures import wait_for

    wait_for(lambda: running_encoders() == 2 and len(replica_names()) == 2, timeout_s=90, what="two replicas")
    before = replica_names()
    # NaN weights: a broken device state that only a real encode (the health probe) can notice.
    victim = encoder_handle.inject_fault.remote("corrupt").result(timeout_s=30)
    assert victim in before
    wait_for(lambda: victim not in replica_names(), timeout_s=60, what="Serve to stop the unhealthy replica")
    wait_for(
        lambda: running_encoders() == 2 and len(replica_names() - before) == 1,
        timeout_s=90,
        what="the replacement replica",
    )
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        for data, expected in images * 3:  # both replicas (one per size) answer correctly
            np.testing.assert_allclose(post(c, data).json()["data"][0]["embedding"], expected, atol=ATOL)
