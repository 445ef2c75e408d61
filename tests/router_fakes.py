"""Fake replicas for the `BucketRouter` tests (`tests/unit/deployments/test_router*.py`): no Ray cluster, Ray's
real routing loop.

The fakes mimic what Ray's `RequestRouter` reads from a `RunningReplica`: `replica_id`,
`max_ongoing_requests`, `routing_stats`, `replica_metadata`, `node_id`, `availability_zone`,
`multiplexed_model_ids` and the async `get_queue_len(deadline_s=...)` probe. The tests drive the base
class's own `_choose_replica_for_request` (routing tasks, queue-length cache, probes, ranked groups),
so they check what Ray does with the groups `BucketRouter.choose_replicas` returns.
"""

from __future__ import annotations

import asyncio
import uuid

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.routing.router import BucketRouter
from deployments.routing.stats import BucketRoutingStats
from workspace.buckets import BucketKey, BucketTable

DEPLOYMENT = DeploymentID(name="Encoder", app_name="test")
TWO = BucketTable([BucketKey(256, 4), BucketKey(4096, 64)])  # small and large
SMALL, LARGE = TWO.keys
TWO_STATS = BucketRoutingStats.from_table(TWO).to_dict()


class FakeReplica:
    """What Ray's router reads from a RunningReplica; `queue_len` is what a probe answers."""

    def __init__(self, uid: str, stats: dict | None = None, *, max_ongoing: int = 8, queue_len: int = 0):
        self.replica_id = ReplicaID(uid, DEPLOYMENT)
        self.routing_stats = {} if stats is None else stats
        self.replica_metadata: dict = {}
        self.max_ongoing_requests = max_ongoing
        self.node_id = "node-1"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.queue_len = queue_len
        self.probes = 0

    @property
    def uid(self) -> str:
        return self.replica_id.unique_id

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        return self.queue_len

    def __repr__(self) -> str:
        return f"FakeReplica({self.uid})"


class FakeResult:
    """A ReplicaResult stand-in: done-callbacks run when the test calls finish()."""

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, callback):
        self.callbacks.append(callback)

    def finish(self):
        for callback in self.callbacks:
            callback(None)


def make_router(**kwargs) -> BucketRouter:
    """Most tests check affinity and the saturation spill alone: the idle-spill rule is off unless given
    (its own tests turn it on)."""
    kwargs.setdefault("idle_spill_queue_len", None)
    router = BucketRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
        self_node_id="node-1",
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
    )
    router.initialize_state(**kwargs)
    return router


def request(num_patches=None, **kwargs) -> PendingRequest:
    """Must be called inside a running loop (PendingRequest creates an asyncio.Future)."""
    if num_patches is not None:
        kwargs["num_patches"] = num_patches
    rid = uuid.uuid4().hex
    return PendingRequest(args=["pixels"], kwargs=kwargs, metadata=RequestMetadata(rid, rid, "encode_pixels"))


async def route(router: BucketRouter, num_patches=None, *, send: bool = True, **kwargs) -> FakeReplica:
    """Route one request through Ray's loop; `send` also books it like Ray does after sending."""
    replica = await asyncio.wait_for(router._choose_replica_for_request(request(num_patches, **kwargs)), 5)
    if send:
        router.on_send_request(replica.replica_id)  # what Ray's handle does after try_send_request
        replica.queue_len += 1
    return replica


async def settle(router: BucketRouter) -> None:
    """Let the probes update_replicas started finish."""
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


async def two_replicas(router: BucketRouter, *, max_ongoing: int) -> tuple[FakeReplica, FakeReplica]:
    """Replicas "a" and "b", both publishing TWO's buckets, handed to `router`, their first probes answered."""
    a, b = FakeReplica("a", TWO_STATS, max_ongoing=max_ongoing), FakeReplica("b", TWO_STATS, max_ongoing=max_ongoing)
    router.update_replicas([a, b])
    await settle(router)
    return a, b
