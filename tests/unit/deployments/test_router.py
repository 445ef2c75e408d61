"""Unit tests for deployments.router: no Ray cluster, fake replicas, Ray's real routing loop.

The fakes mimic what Ray's `RequestRouter` reads from a `RunningReplica`: `replica_id`,
`max_ongoing_requests`, `routing_stats`, `replica_metadata`, `node_id`, `availability_zone`,
`multiplexed_model_ids` and the async `get_queue_len(deadline_s=...)` probe. Most tests drive the base
class's own `_choose_replica_for_request` (routing tasks, queue-length cache, probes, ranked groups),
so they check what Ray does with the groups `BucketRouter.choose_replicas` returns.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.router import BucketRouter, BucketRouterConfig
from deployments.router_assignment import assign_buckets
from deployments.routing_stats import STATS_BUCKETS, BucketRoutingStats
from workspace.buckets import BucketError, BucketKey, BucketTable
from workspace.tables import router_fallback_table

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


# -- routing through Ray's loop ---------------------------------------------------------------------------


def test_affinity_each_bucket_goes_to_its_owner():
    async def body():
        router = make_router()
        b = FakeReplica("replica-b", TWO_STATS, max_ongoing=100)
        a = FakeReplica("replica-a", TWO_STATS, max_ongoing=100)
        router.update_replicas([b, a])  # candidate order must not matter
        await settle(router)
        plan = router.plan(router._replicas_list)
        assert plan.table == TWO and plan.table_source == "replicas"
        for _ in range(3):
            assert (await route(router, 200)).uid == "replica-a"  # bucket 256 -> lower id
            assert (await route(router, 3000)).uid == "replica-b"  # bucket 4096 -> higher id
            assert (await route(router, 4096, num_images=2)).uid == "replica-b"
            assert (await route(router, 100_000)).uid == "replica-b"  # above every bucket: the largest
            assert (await route(router, 200, num_images=5)).uid == "replica-b"  # 5 images need the large bucket
        assert (await route(router, [100, 100])).uid == "replica-a"

    run(body())


def test_balances_by_queue_length_inside_the_owner_set():
    async def body():
        router = make_router(spill_queue_len=100)
        replicas = [FakeReplica(f"r{i}", TWO_STATS, max_ongoing=100) for i in range(4)]
        router.update_replicas(replicas)
        await settle(router)
        owners = router.plan(router._replicas_list).owners
        small_owners = {rid.unique_id for rid in owners[SMALL]}
        assert small_owners == {"r0", "r1"} and {rid.unique_id for rid in owners[LARGE]} == {"r2", "r3"}
        replicas[0].queue_len = 5
        router.on_new_queue_len_info(replicas[0].replica_id, 5)
        chosen = [(await route(router, 200)).uid for _ in range(10)]
        assert set(chosen) == small_owners  # never the large bucket's owners
        assert chosen[:5] == ["r1"] * 5  # the shorter queue first, until queues are level
        assert abs(replicas[0].queue_len - replicas[1].queue_len) <= 1

    run(body())


def test_spill_when_owner_queue_reaches_threshold():
    async def body():
        router = make_router(spill_fraction=0.5, spill_patches=0)
        a, b = FakeReplica("a", TWO_STATS, max_ongoing=8), FakeReplica("b", TWO_STATS, max_ongoing=8)
        router.update_replicas([a, b])
        await settle(router)
        assert router.spill_queue_len(a) == 4
        chosen = [(await route(router, 200)).uid for _ in range(6)]
        assert chosen == ["a"] * 4 + ["b"] * 2  # a owns 256; at 4 queued (>= 0.5 * 8) it spills to b
        # b has room for the large bucket it owns, below its own threshold
        assert (await route(router, 3000)).uid == "b"
        assert (await route(router, 3000)).uid == "b"  # b at 4 now: saturated as well
        # Both saturated: owners come first again, Ray only needs a queue below max_ongoing_requests
        assert (await route(router, 200)).uid == "a"
        assert (await route(router, 3000)).uid == "b"

    run(body())


def test_spill_when_owner_is_full_even_without_an_early_threshold():
    async def body():
        router = make_router(spill_fraction=1.0, spill_patches=0)
        a, b = FakeReplica("a", TWO_STATS, max_ongoing=2), FakeReplica("b", TWO_STATS, max_ongoing=2)
        router.update_replicas([a, b])
        await settle(router)
        assert [(await route(router, 200)).uid for _ in range(4)] == ["a", "a", "b", "b"]
        # all full: Ray backs off and retries until a slot frees up
        pending = asyncio.ensure_future(route(router, 200, send=False))
        await asyncio.sleep(0.2)
        assert not pending.done()
        a.queue_len = 1  # a request on a finished; the next probe sees it
        assert (await asyncio.wait_for(pending, 5)).uid == "a"

    run(body())


def test_spill_by_patches_in_flight():
    async def body():
        router = make_router(spill_queue_len=100, spill_patches=5000)
        a, b = FakeReplica("a", TWO_STATS, max_ongoing=100), FakeReplica("b", TWO_STATS, max_ongoing=100)
        router.update_replicas([a, b])
        await settle(router)
        results = []
        for _ in range(2):
            pr = request(3000)
            replica = await router._choose_replica_for_request(pr)
            assert replica.uid == "b"
            result = FakeResult()
            router.on_request_routed(pr, replica.replica_id, result)
            results.append(result)
        assert router.inflight_patches(b.replica_id) == 6000
        assert (await route(router, 3000)).uid == "a"  # b holds 6000 >= 5000 patches: spill
        results[0].finish()
        await settle(router)  # the release hops through the loop
        assert router.inflight_patches(b.replica_id) == 3000
        assert (await route(router, 3000)).uid == "b"
        results[1].finish()
        await settle(router)
        assert router.inflight_patches(b.replica_id) == 0
        assert router.spill_patches(router.plan(router._replicas_list)) == 5000
        assert make_router().spill_patches(router.plan(router._replicas_list)) == 2 * 4096

    run(body())


def test_replica_removal_and_addition():
    async def body():
        router = make_router()
        r = {uid: FakeReplica(uid, TWO_STATS, max_ongoing=100) for uid in ("a", "b", "c")}
        router.update_replicas(list(r.values()))
        await settle(router)
        # 3 replicas, 2 buckets: small -> a, large -> b, c (extra owners go to the largest bucket)
        assert {(await route(router, 200)).uid for _ in range(4)} == {"a"}
        assert {(await route(router, 3000)).uid for _ in range(4)} == {"b", "c"}
        router.update_replicas([r["b"], r["c"]])  # a removed
        await settle(router)
        assert {(await route(router, 200)).uid for _ in range(3)} == {"b"}
        assert {(await route(router, 3000)).uid for _ in range(3)} == {"c"}
        router.on_replica_actor_died(r["c"].replica_id)  # c dies before the controller notices
        assert {(await route(router, 3000)).uid for _ in range(2)} == {"b"}
        router.update_replicas(list(r.values()))  # all back: the original, stateless assignment
        await settle(router)
        assert {(await route(router, 200)).uid for _ in range(2)} == {"a"}
        assert r["a"].probes >= 1  # a new replica is probed once it joins

    run(body())


def test_rendezvous_strategy_routes_to_its_owners():
    async def body():
        router = make_router(assignment="rendezvous", spill_queue_len=100)
        replicas = [FakeReplica(f"r{i}", TWO_STATS, max_ongoing=100) for i in range(3)]
        router.update_replicas(replicas)
        await settle(router)
        expected = assign_buckets(TWO, [x.uid for x in replicas], "rendezvous")
        assert {(await route(router, 200)).uid for _ in range(4)} <= set(expected[SMALL])
        assert {(await route(router, 3000)).uid for _ in range(4)} <= set(expected[LARGE])

    run(body())


def test_missing_num_patches_falls_back_to_power_of_two_choices():
    async def body():
        router = make_router()
        replicas = [FakeReplica(f"r{i}", TWO_STATS, max_ongoing=1000) for i in range(4)]
        router.update_replicas(replicas)
        await settle(router)
        pr = request(None)
        groups = await router.choose_replicas(router._replicas_list, pr)
        assert len(groups) == 1 and len(groups[0]) == 2 and len(set(groups[0])) == 2
        assert pr.routing_context.should_backoff  # Ray's loop backs off between rounds
        assert len((await router.choose_replicas(router._replicas_list, None))[0]) == 2
        random.seed(0)
        seen = {(await route(router, None)).uid for _ in range(40)}
        assert seen == {"r0", "r1", "r2", "r3"}  # not pinned to any bucket owner
        seen = {(await route(router, None, other="x")).uid for _ in range(40)}
        assert len(seen) == 4

    run(body())


def test_empty_candidates():
    async def body():
        router = make_router()
        assert await router.choose_replicas([], request(200)) == []

    run(body())


def test_missing_stats_use_the_default_or_configured_table():
    async def body():
        router = make_router()
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router.update_replicas(replicas)
        await settle(router)
        plan = router.plan(router._replicas_list)
        assert plan.table == router_fallback_table() and plan.table_source == "default"
        assert (await route(router, 256)).uid == "a"  # 256..2048 -> a
        assert (await route(router, 9216)).uid == "b"  # 4096..32768 -> b

        router = make_router(buckets="256,4096")
        router.update_replicas(replicas)
        plan = router.plan(router._replicas_list)
        assert plan.table == BucketTable.parse("256,4096") and plan.table_source == "config"
        assert (await route(router, 300)).uid == "b"

    run(body())


def test_table_from_replica_metadata_and_majority():
    async def body():
        router = make_router()
        a = FakeReplica("a")
        a.replica_metadata = {STATS_BUCKETS: [[256, 4], [4096, 64]]}
        b = FakeReplica("b")
        router.update_replicas([a, b])
        assert router.plan(router._replicas_list).table == TWO
        # routing stats win over metadata; the table most replicas publish wins
        three = BucketRoutingStats(buckets=[[256, 4], [1024, 16], [4096, 64]]).to_dict()
        replicas = [FakeReplica("a", three), FakeReplica("b", TWO_STATS), FakeReplica("c", three)]
        replicas[1].replica_metadata = three
        router.update_replicas(replicas)
        assert router.plan(router._replicas_list).table == BucketRoutingStats.model_validate(three).table()

    run(body())


def test_unreadable_stats_are_ignored_with_one_warning(caplog):
    async def body():
        router = make_router()
        bad = FakeReplica("a", {STATS_BUCKETS: [[256, 4], [256, 8]]})
        for _ in range(2):
            router.update_replicas([bad, FakeReplica("b", TWO_STATS)])
            assert router.plan(router._replicas_list).table == TWO

    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        run(body())
    assert sum("unreadable routing stats" in r.message for r in caplog.records) == 1


def test_not_ready_replicas_rank_last():
    async def body():
        router = make_router()
        warming = BucketRoutingStats.from_table(TWO, ready=False).to_dict()
        a, b = FakeReplica("a", warming), FakeReplica("b", TWO_STATS)
        router.update_replicas([a, b])
        await settle(router)
        groups = await router.choose_replicas(router._replicas_list, request(200))
        assert [[r.uid for r in g] for g in groups] == [["b"], ["a"]]
        assert (await route(router, 200)).uid == "b"

    run(body())


def test_ranked_groups():
    async def body():
        router = make_router(spill_queue_len=3, spill_patches=0)
        r = [FakeReplica(f"r{i}", TWO_STATS, max_ongoing=10) for i in range(4)]
        router.update_replicas(r)
        await settle(router)  # probes: all at 0
        for replica, queue_len in zip(r, (3, 0, 5, 1), strict=True):
            router.on_new_queue_len_info(replica.replica_id, queue_len)
        pr = request(200)
        uids = lambda groups: [[x.uid for x in g] for g in groups]  # noqa: E731
        # owners of 256: r0, r1; r0 saturated (3 >= 3), r2 saturated. First round: free owners only.
        assert uids(await router.choose_replicas(router._replicas_list, pr)) == [["r1"]]
        assert not pr.routing_context.should_backoff  # Ray retries at once
        assert uids(await router.choose_replicas(router._replicas_list, pr)) == [["r1"], ["r3"], ["r0"], ["r2"]]
        assert pr.routing_context.should_backoff
        router.on_new_queue_len_info(r[1].replica_id, 4)
        # no free owner: the full ranking right away
        assert uids(await router.choose_replicas(router._replicas_list, request(200))) == [["r3"], ["r0", "r1"], ["r2"]]

    run(body())


def test_an_idle_replica_takes_requests_whose_owner_has_a_queue():
    """Uniform traffic: the owner of the bucket runs one batch with one waiting, the idle replica gets
    the next request; once it has work it is no longer idle and the owner queues again."""

    async def body():
        router = make_router(spill_queue_len=100, spill_patches=0, idle_spill_queue_len=2)
        a, b = FakeReplica("a", TWO_STATS, max_ongoing=100), FakeReplica("b", TWO_STATS, max_ongoing=100)
        router.update_replicas([a, b])
        await settle(router)
        assert [(await route(router, 200)).uid for _ in range(5)] == ["a", "a", "b", "a", "a"]
        b.queue_len = 0  # b finished its request; the next probe or send reports it
        router.on_new_queue_len_info(b.replica_id, 0)
        assert (await route(router, 200)).uid == "b"
        # large requests: b owns them and is light; a (queue 4) is not idle, so never a spill target
        assert [(await route(router, 3000)).uid for _ in range(4)] == ["b"] * 4

    run(body())


def test_a_non_owner_busy_with_other_sizes_never_takes_the_idle_spill():
    """Mixed load: small images queue at their owner rather than join the large images' replica."""

    async def body():
        router = make_router(spill_queue_len=100, spill_patches=0, idle_spill_queue_len=2)
        a, b = FakeReplica("a", TWO_STATS, max_ongoing=100), FakeReplica("b", TWO_STATS, max_ongoing=100)
        router.update_replicas([a, b])
        await settle(router)
        assert (await route(router, 3000)).uid == "b"  # b holds one large request
        assert [(await route(router, 200)).uid for _ in range(30)] == ["a"] * 30
        pr = request(200)
        assert [[r.uid for r in g] for g in await router.choose_replicas(router._replicas_list, pr)] == [["a"]]
        groups = await router.choose_replicas(router._replicas_list, pr)  # the next round: the full ranking
        assert [[r.uid for r in g] for g in groups] == [["a"], ["b"]]  # owner (not saturated), then b

    run(body())


def test_ranked_groups_with_idle_spill():
    async def body():
        router = make_router(spill_queue_len=5, spill_patches=0, idle_spill_queue_len=2)
        r = [FakeReplica(f"r{i}", TWO_STATS, max_ongoing=10) for i in range(4)]
        router.update_replicas(r)
        await settle(router)
        for replica, queue_len in zip(r, (1, 3, 0, 2), strict=True):
            router.on_new_queue_len_info(replica.replica_id, queue_len)
        uids = lambda groups: [[x.uid for x in g] for g in groups]  # noqa: E731
        # owners of 256: r0 (light), r1 (heavy); r2 idle; r3 busy with 2 but unsaturated
        pr = request(200)
        assert uids(await router.choose_replicas(router._replicas_list, pr)) == [["r0"]]
        assert uids(await router.choose_replicas(router._replicas_list, pr)) == [["r0"], ["r2"], ["r1"], ["r3"]]
        router.on_new_queue_len_info(r[0].replica_id, 2)
        # no light owner and an idle replica: the full ranking at once, the idle replica first
        assert uids(await router.choose_replicas(router._replicas_list, request(200))) == [["r2"], ["r0", "r1"], ["r3"]]

    run(body())


class SlowProbeReplica(FakeReplica):
    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        await asyncio.sleep(0.15)  # misses Ray's first 0.1 s deadline, meets the doubled one
        return self.queue_len


@pytest.mark.parametrize("owner_only_rounds, expected", [(1, "a"), (0, "b")])
def test_owner_with_a_slow_probe_gets_a_second_chance(owner_only_rounds, expected):
    async def body():
        router = make_router(owner_only_rounds=owner_only_rounds)
        a, b = SlowProbeReplica("a", TWO_STATS, max_ongoing=100), FakeReplica("b", TWO_STATS, max_ongoing=100)
        router.update_replicas([a, b])
        await asyncio.sleep(0.3)  # initial probes done: both cached
        router.replica_queue_len_cache.invalidate_key(a.replica_id)  # a's length unknown again
        assert (await route(router, 200)).uid == expected
        assert a.probes == 1 + (2 if owner_only_rounds else 1)

    run(body())


def test_a_burst_respects_the_spill_threshold():
    """A whole burst routed before any request is sent still sees its own earlier picks."""

    async def body():
        router = make_router(spill_queue_len=4, spill_patches=0)
        a, b = FakeReplica("a", TWO_STATS, max_ongoing=100), FakeReplica("b", TWO_STATS, max_ongoing=100)
        router.update_replicas([a, b])
        await settle(router)
        chosen = await asyncio.gather(*(router._choose_replica_for_request(request(200)) for _ in range(10)))
        # a saturates at 4, b takes the spill up to its own threshold, then the owner again
        assert [r.uid for r in chosen] == ["a"] * 4 + ["b"] * 4 + ["a"] * 2
        cache = router.replica_queue_len_cache
        assert (cache.get(a.replica_id), cache.get(b.replica_id)) == (6, 4)
        for replica in chosen:  # Ray sends them now: already counted, not again
            router.on_send_request(replica.replica_id)
        assert (cache.get(a.replica_id), cache.get(b.replica_id)) == (6, 4)
        router.on_send_request(a.replica_id)  # an unbooked send counts as usual
        assert cache.get(a.replica_id) == 7
        router.update_replicas([b])
        assert not router._booked.get(a.replica_id)

    run(body())


def test_arrival_order_and_no_cross_bucket_handoff():
    """Ray starts routing requests in arrival order; a replica found for one bucket is never handed to a
    request of another bucket (what FIFOMixin would do, and why BucketRouter does not use it)."""

    async def body():
        router = make_router(spill_queue_len=1000)
        a, b = FakeReplica("a", TWO_STATS, max_ongoing=1000), FakeReplica("b", TWO_STATS, max_ongoing=1000)
        router.update_replicas([a, b])
        await settle(router)
        done: list[int] = []
        sizes = [200, 3000] * 10 + [200] * 10
        requests = [request(n) for n in sizes]
        futures = []
        for i, pr in enumerate(requests):
            future = asyncio.ensure_future(router._choose_replica_for_request(pr))
            future.add_done_callback(lambda _, i=i: done.append(i))
            futures.append(future)
        chosen = await asyncio.wait_for(asyncio.gather(*futures), 5)
        assert [r.uid for r in chosen] == ["a" if n == 200 else "b" for n in sizes]
        small = [i for i in done if sizes[i] == 200]
        assert small == sorted(small)  # same-bucket requests are served in arrival order
        assert done == sorted(done)

    run(body())


def test_inflight_bookkeeping_is_pruned_with_removed_replicas():
    async def body():
        router = make_router()
        a, b = FakeReplica("a", TWO_STATS), FakeReplica("b", TWO_STATS)
        router.update_replicas([a, b])
        pr = request(3000)
        router.on_request_routed(pr, b.replica_id, FakeResult())
        router.on_request_routed(request(None), b.replica_id, FakeResult())  # no size: not counted
        assert router.inflight_patches(b.replica_id) == 3000
        router.update_replicas([a])
        assert router.inflight_patches(b.replica_id) == 0 and not router._inflight

    run(body())


# -- configuration ----------------------------------------------------------------------------------------


def test_router_kwargs_are_validated():
    with pytest.raises(ValueError):
        make_router(spill_fraction=0)
    with pytest.raises(ValueError):
        make_router(assignment="random")
    with pytest.raises(ValueError):
        make_router(unknown=1)
    with pytest.raises(BucketError):
        make_router(buckets="256,abc")
    router = make_router(spill_fraction=0.25, assignment="rendezvous", buckets=[256, 1024])
    assert router.config == BucketRouterConfig(
        spill_fraction=0.25, assignment="rendezvous", buckets=[256, 1024], idle_spill_queue_len=None
    )
    assert BucketRouterConfig().idle_spill_queue_len == 2  # on by default
    assert router.spill_queue_len(FakeReplica("a", max_ongoing=512)) == 128
    assert router.spill_queue_len(FakeReplica("a", max_ongoing=1)) == 1


def test_request_router_config_accepts_the_class():
    config = RequestRouterConfig(
        request_router_class=BucketRouter,
        request_router_kwargs=BucketRouterConfig(spill_fraction=0.75).model_dump(exclude_defaults=True),
    )
    assert config.request_router_class == "deployments.router.BucketRouter"
    assert config.get_request_router_class().__name__ == "BucketRouter"
    for path in ("deployments.router.BucketRouter", "deployments.router:BucketRouter"):
        assert RequestRouterConfig(request_router_class=path).get_request_router_class().__name__ == "BucketRouter"


def test_inflight_patches_are_tracked_per_call_even_with_a_shared_request_id():
    """Concurrent encoder calls made for one ingress request share Serve's internal request id;
    finishing one must release only its own patches."""

    async def body():
        router = make_router()
        a, b = FakeReplica("a", TWO_STATS), FakeReplica("b", TWO_STATS)
        router.update_replicas([a, b])
        first = request(3000)
        second = PendingRequest(args=["pixels"], kwargs={"num_patches": 2000}, metadata=first.metadata)
        r1, r2 = FakeResult(), FakeResult()
        router.on_request_routed(first, b.replica_id, r1)
        router.on_request_routed(second, b.replica_id, r2)
        assert router.inflight_patches(b.replica_id) == 5000
        r1.finish()
        await settle(router)
        assert router.inflight_patches(b.replica_id) == 2000
        r2.finish()
        await settle(router)
        assert router.inflight_patches(b.replica_id) == 0

    run(body())
