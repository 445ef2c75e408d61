"""Unit tests for deployments.routing.router, routing through Ray's loop with fake replicas (`tests/router_fakes.py`):
bucket affinity, balance inside the owner set, the saturation spill, replicas coming and going, the fallback
without sizes or stats. The ranked groups, the idle spill, bursts and the configuration are in
`test_router_ranking.py`; the pure assignment and stats in `test_router_assignment.py`.
"""

from __future__ import annotations

import asyncio
import logging
import random

from deployments.routing.assignment import assign_buckets
from deployments.routing.stats import STATS_BUCKETS, BucketRoutingStats
from tests.router_fakes import (
    LARGE,
    SMALL,
    TWO,
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
from workspace.buckets import BucketTable
from workspace.tables import router_fallback_table

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
        a, b = await two_replicas(router, max_ongoing=8)
        assert router.spill_queue_len(a) == 4
        assert router.spill_queue_len(FakeReplica("c", max_ongoing=7)) == 4  # 0.5 x 7, rounded up
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
        a, b = await two_replicas(router, max_ongoing=2)
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
        router = make_router(spill_queue_len=100, spill_patches=6000)
        a, b = await two_replicas(router, max_ongoing=100)
        results = []
        for _ in range(2):
            pr = request(3000)
            replica = await router._choose_replica_for_request(pr)
            assert replica.uid == "b"
            result = FakeResult()
            router.on_request_routed(pr, replica.replica_id, result)
            results.append(result)
        assert router.inflight_patches(b.replica_id) == 6000
        assert (await route(router, 3000)).uid == "a"  # b holds 6000 >= 6000 patches (at the limit): spill
        results[0].finish()
        await settle(router)  # the release hops through the loop
        assert router.inflight_patches(b.replica_id) == 3000
        assert (await route(router, 3000)).uid == "b"
        results[1].finish()
        await settle(router)
        assert router.inflight_patches(b.replica_id) == 0
        assert router.spill_patches(router.plan(router._replicas_list)) == 6000
        assert make_router().spill_patches(router.plan(router._replicas_list)) == 2 * 4096

    run(body())


def test_spill_by_patches_counts_whole_batches_where_they_exceed_the_buckets():
    """A CPU replica runs batches of 8192 patches over buckets of at most 1024 (the ingress sends calls that big):
    the default limit is two of its batches. Broken: 2 x 1024, so one 2048-patch call saturated its owner and
    the next call of that size spilled to the other replica (b, a, b, ...)."""

    async def body():
        router = make_router(spill_queue_len=100)
        cpu = BucketRoutingStats.from_table(BucketTable.from_budgets([256, 1024]), max_batch_patches=8192).to_dict()
        assert cpu["max_batch_patches"] == 8192
        router.update_replicas([FakeReplica("a", cpu, max_ongoing=100), FakeReplica("b", cpu, max_ongoing=100)])
        await settle(router)
        assert router.spill_patches(router.plan(router._replicas_list)) == 2 * 8192
        chosen = []
        for _ in range(4):  # 2048-patch calls, each booked as Ray books it: 8192 in flight, under two batches
            pr = request(2048)
            replica = await router._choose_replica_for_request(pr)
            router.on_request_routed(pr, replica.replica_id, FakeResult())
            chosen.append(replica.uid)
        assert len(set(chosen)) == 1, chosen  # no spill
        # replicas that publish no batch limit (older ones): the buckets' rule
        plain = BucketRoutingStats.from_table(BucketTable.from_budgets([256, 1024])).to_dict()
        router.update_replicas([FakeReplica("c", plain), FakeReplica("d", plain)])
        assert router.spill_patches(router.plan(router._replicas_list)) == 2 * 1024

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
        # routing stats win over metadata; the table most replicas publish wins, not the first replica's
        three = BucketRoutingStats(buckets=[[256, 4], [1024, 16], [4096, 64]]).to_dict()
        replicas = [FakeReplica("a", three), FakeReplica("b", TWO_STATS), FakeReplica("c", TWO_STATS)]
        replicas[1].replica_metadata = three
        router.update_replicas(replicas)
        assert router.plan(router._replicas_list).table == TWO
        # stats without a table still win over the metadata's other keys (it was published at start-up)
        c = FakeReplica("c", {"ready": False})
        c.replica_metadata = TWO_STATS
        router.update_replicas([FakeReplica("a", three), c])
        assert router.plan(router._replicas_list).not_ready == {c.replica_id}

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
