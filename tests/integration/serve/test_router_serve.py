"""BucketRouter on a local Ray Serve: two CPU replicas that answer with their replica id.

Checks, through a real DeploymentHandle: the router picks up the bucket table the replicas publish
with `record_routing_stats`, each bucket goes to its owner replica, and requests spill to the other
replica when the owner is saturated. Shares the session's Ray instance (`tests.serve_fixtures`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.routing.router import BucketRouter
from deployments.routing.stats import BucketRoutingStats

pytestmark = pytest.mark.slow

APP = "bucket-router-test"
# Published table: 256 and 1024. The router's default table (256..32768) gives 1024 to the *lower* id
# of two replicas, the published one to the higher: that tells when the replicas' stats arrived.
PUBLISHED = [[256, 4], [1024, 16]]


def echo_app():
    # Defined in a function so that Ray pickles the class by value (tests/ is not importable on workers).
    @serve.deployment(
        name="EchoEncoder",
        num_replicas=2,
        max_ongoing_requests=32,
        ray_actor_options={"num_cpus": 0.1},
        request_router_config=RequestRouterConfig(
            request_router_class=BucketRouter,
            # Work conservation off. With it on, a sequential call goes to the idle non-owner whenever the
            # owner's cached queue length still counts earlier calls (>= 2: the replica reports its count
            # before it drops a finished call, and Ray's decrement runs later, on the router's loop). The
            # affinity check below failed that way in 1 of 20 fresh-clone CI runs on 2026-12-03. Its ranking
            # is unit-tested (tests/unit/deployments/routing/test_router_ranking.py).
            request_router_kwargs={"spill_queue_len": 4, "spill_patches": 0, "idle_spill_queue_len": None},
            request_routing_stats_period_s=0.5,
        ),
    )
    class EchoEncoder:
        def __init__(self):
            self.replica_id = serve.get_replica_context().replica_id.unique_id

        def record_routing_stats(self) -> dict:
            return BucketRoutingStats(buckets=PUBLISHED).to_dict()

        async def encode_pixels(self, pixels, pooling="mean", num_patches=None, delay_s=0.0):
            import asyncio

            await asyncio.sleep(delay_s)
            return self.replica_id

    return EchoEncoder.bind()


@pytest.fixture(scope="module")
def handle(ray_cluster):
    from tests.serve_fixtures import running_app

    with running_app(echo_app(), APP, route_prefix=None) as service:
        yield service.handle


def call(handle, num_patches, delay_s=0.0) -> str:
    return handle.encode_pixels.remote(b"pixels", pooling="mean", num_patches=num_patches, delay_s=delay_s).result(
        timeout_s=30
    )


def test_each_bucket_goes_to_its_replica_and_spills_when_saturated(handle):
    small_owner = call(handle, 200)
    large_owner = call(handle, 50_000)  # above every bucket: routed as the largest
    assert small_owner != large_owner
    assert small_owner < large_owner  # lower replica id owns the smaller buckets

    # The published table reaches the router within a few stats periods.
    deadline = time.monotonic() + 20
    while call(handle, 1000) != large_owner:
        assert time.monotonic() < deadline, "the router never used the table the replicas publish"
        time.sleep(0.2)

    # Affinity: sequential calls (queues stay short) always land on the bucket's owner. (A replica's
    # count of ongoing requests can lag a finished call by one, so the spill threshold is not 1 or 2.)
    assert [call(handle, 200) for _ in range(15)] == [small_owner] * 15
    assert [call(handle, 1000) for _ in range(15)] == [large_owner] * 15
    assert [call(handle, [300, 400]) for _ in range(5)] == [large_owner] * 5  # 700 patches, 2 images

    # Spill: 12 concurrent slow large-bucket calls. The owner saturates at 4 queued, the next ones
    # spill to the other replica until it has 4 too, then both are saturated and the owner comes
    # first again (measured here: 4 owner, 4 spilled, 4 owner; allow one of slack for timing).
    with ThreadPoolExecutor(12) as pool:
        served = list(pool.map(lambda _: call(handle, 1000, delay_s=1.0), range(12)))
    assert served.count(large_owner) >= 4, served
    assert served.count(small_owner) >= 3, served

    # Drained: back to the owner once the calls' completions have reached the router's queue counts (a
    # spilled call can land while they are on their way), and then every time.
    deadline = time.monotonic() + 20
    while call(handle, 1000) != large_owner:
        assert time.monotonic() < deadline, "the router never went back to the owner after the spill"
    assert [call(handle, 1000) for _ in range(5)] == [large_owner] * 5
