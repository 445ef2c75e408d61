"""Unit tests for deployments.routing.router's ranked groups (fake replicas, Ray's routing loop:
`tests/router_fakes.py`):
the idle spill, a slow probe's second chance, bursts against the spill threshold, arrival order, in-flight
bookkeeping, and the router's configuration.
"""

from __future__ import annotations

import asyncio

import pytest
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest

from deployments.routing.router import BucketRouter, BucketRouterConfig
from tests.router_fakes import (
    TWO_STATS,
    FakeReplica,
    FakeResult,
    make_router,
    request,
    route,
    run,
    settle,
    two_replicas,
)
from workspace.buckets import BucketError


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
        a, b = await two_replicas(router, max_ongoing=100)
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
        a, b = await two_replicas(router, max_ongoing=100)
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
        a, b = await two_replicas(router, max_ongoing=100)
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
        a, b = await two_replicas(router, max_ongoing=1000)
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
    assert config.request_router_class == "deployments.routing.router.BucketRouter"
    assert config.get_request_router_class().__name__ == "BucketRouter"
    for path in ("deployments.routing.router.BucketRouter", "deployments.routing.router:BucketRouter"):
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
