"""Unit tests for the router's pure parts: the stats replicas publish (deployments.routing.stats), the size
of a request and the assignment of buckets to replicas (deployments.routing.assignment). The routing loop
itself, with fake replicas, is tests/unit/deployments/routing/test_router.py and test_router_ranking.py."""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.routing.assignment import assign_buckets, request_size
from deployments.routing.router import BucketRouterConfig
from deployments.routing.stats import STATS_BUCKETS, STATS_QUEUED_BY_BUCKET, STATS_READY, BucketRoutingStats
from workspace.buckets import BucketError, BucketKey, BucketTable
from workspace.tables import router_fallback_table

TWO = BucketTable([BucketKey(256, 4), BucketKey(4096, 64)])  # small and large
SMALL, LARGE = TWO.keys


def run(coro):
    return asyncio.run(coro)


# -- published stats --------------------------------------------------------------------------------------


def test_stats_dict_shape_and_roundtrip():
    stats = BucketRoutingStats.from_table(TWO, queued_by_bucket={256: 3}, ready=False).to_dict()
    assert stats == {STATS_BUCKETS: [[256, 4], [4096, 64]], STATS_QUEUED_BY_BUCKET: {256: 3}, STATS_READY: False}
    assert (STATS_BUCKETS, STATS_QUEUED_BY_BUCKET, STATS_READY) == ("buckets", "queued_by_bucket", "ready")
    parsed = BucketRoutingStats.model_validate(stats)
    assert parsed.table() == TWO and parsed.ready is False and parsed.queued_by_bucket == {256: 3}
    # JSON-ish input: string budgets as keys, ready defaults to True, unknown keys ignored
    parsed = BucketRoutingStats.model_validate({"buckets": [[256, 4]], "queued_by_bucket": {"256": 1}, "x": 1})
    assert parsed.queued_by_bucket == {256: 1} and parsed.ready


def test_stats_bare_budgets_and_bad_tables():
    assert BucketRoutingStats(buckets=[256, 1024]).table() == BucketTable.from_budgets([256, 1024])
    with pytest.raises(BucketError, match="mixed"):
        BucketRoutingStats(buckets=[256, [1024, 16]]).table()
    with pytest.raises(BucketError, match="duplicate"):
        BucketRoutingStats(buckets=[[256, 4], [256, 8]]).table()
    with pytest.raises(ValueError):
        BucketRoutingStats(buckets=[])


def test_default_table_is_the_engine_default():
    import pickle

    from workspace.buckets import BucketTable, default_table

    assert BucketRouterConfig().default_table() == router_fallback_table() == default_table()
    assert router_fallback_table() != default_table(16384)
    table = BucketTable.parse("256,1024")
    assert pickle.loads(pickle.dumps(table)) == table


# -- request size -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, size",
    [
        ({"num_patches": 200}, (200, 1)),
        ({"num_patches": 900, "num_images": 3}, (900, 3)),
        ({"num_patches": [256, 1024, 64]}, (1344, 3)),
        ({"num_patches": (256,)}, (256, 1)),
        ({}, None),
        ({"num_patches": None}, None),
        ({"num_patches": 0}, None),
        ({"num_patches": -5}, None),
        ({"num_patches": True}, None),
        ({"num_patches": 2.5}, None),
        ({"num_patches": "256"}, None),
        ({"num_patches": []}, None),
        ({"num_patches": [256, 0]}, None),
        ({"num_patches": 256, "num_images": 0}, None),
    ],
)
def test_request_size(kwargs, size):
    async def body():
        pr = PendingRequest(args=[], kwargs=kwargs, metadata=RequestMetadata("r", "r"))
        return request_size(pr)

    assert run(body()) == size


def test_request_size_of_no_request_and_custom_kwarg():
    assert request_size(None) is None

    async def body():
        pr = PendingRequest(args=[], kwargs={"patches": 300}, metadata=RequestMetadata("r", "r"))
        return request_size(pr), request_size(pr, num_patches_kwarg="patches")

    assert run(body()) == (None, (300, 1))


# -- assignment -------------------------------------------------------------------------------------------


def test_ranges_two_replicas_two_buckets():
    assert assign_buckets(TWO, ["b", "a"]) == {SMALL: ("a",), LARGE: ("b",)}


@pytest.mark.parametrize("num_replicas", range(1, 20))
def test_ranges_are_contiguous_ordered_and_balanced(num_replicas):
    table = router_fallback_table()
    ids = [uuid.uuid4().hex[:12] for _ in range(num_replicas)]
    owners = assign_buckets(table, ids)
    assert list(owners) == list(table.keys)
    ranks = {rid: i for i, rid in enumerate(sorted(ids))}
    if num_replicas <= len(table):
        per_replica = [[k for k in table.keys if owners[k] == (rid,)] for rid in sorted(ids)]
        counts = [len(keys) for keys in per_replica]
        assert max(counts) - min(counts) <= 1 and sum(counts) == len(table) and min(counts) >= 1
        assert counts == sorted(counts, reverse=True)  # the longer ranges come first (small buckets)
        flat = [k for keys in per_replica for k in keys]
        assert flat == list(table.keys)  # lower ids own the smaller buckets, contiguously
    else:
        sizes = [len(owners[k]) for k in table.keys]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == num_replicas
        assert sizes == sorted(sizes)  # extra owners go to the largest buckets
        order = [ranks[rid] for k in table.keys for rid in owners[k]]
        assert order == list(range(num_replicas))  # every replica owns exactly one bucket, in order


@pytest.mark.parametrize("strategy", ["ranges", "rendezvous"])
def test_assignment_is_a_function_of_the_set(strategy):
    table = router_fallback_table()
    ids = [uuid.uuid4().hex[:12] for _ in range(5)]
    first = assign_buckets(table, ids, strategy)
    for perm in itertools.islice(itertools.permutations(ids), 20):
        assert assign_buckets(table, list(perm) + [ids[0]], strategy) == first  # order and duplicates ignored
    assert assign_buckets(table, [], strategy) == {k: () for k in table.keys}
    with pytest.raises(ValueError, match="unknown assignment"):
        assign_buckets(table, ids, "round-robin")


def test_default_table_two_replicas_separate_224_and_1344_images():
    table = router_fallback_table()
    small = table.bucket_for(256, 1)  # 224x224
    large = table.bucket_for(9216, 1)  # 1344x1344
    for _ in range(50):
        ids = [uuid.uuid4().hex[:12] for _ in range(2)]
        owners = assign_buckets(table, ids)
        assert owners[small] != owners[large]
    interleaved = {key: rank % 2 for rank, key in enumerate(reversed(table.keys))}  # every other bucket
    assert interleaved[small] == interleaved[large]  # why buckets are not interleaved over replicas


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 5, 8, 9, 13])
def test_rendezvous_is_balanced(num_replicas):
    table = router_fallback_table()
    rng = random.Random(num_replicas)
    for _ in range(20):
        ids = [f"{rng.getrandbits(48):012x}" for _ in range(num_replicas)]
        owners = assign_buckets(table, ids, "rendezvous")
        load = {rid: sum(rid in o for o in owners.values()) for rid in ids}
        assert max(load.values()) - min(load.values()) <= 1
        if num_replicas > len(table):
            assert set(load.values()) == {1}
        assert all(owners[k] for k in table.keys)


def _moved(before: dict, after: dict, removed: str | None = None) -> int:
    """Buckets whose owner set changed, not counting those that lost the removed replica."""
    return sum(1 for k in before if before[k] != after[k] and (removed is None or removed not in before[k]))


def test_rendezvous_moves_fewer_buckets_than_ranges_when_replicas_come_and_go():
    table = router_fallback_table()
    rng = random.Random(0)
    joins = {"ranges": 0, "rendezvous": 0}
    leaves = {"ranges": 0, "rendezvous": 0}
    for _ in range(300):
        ids = [f"{rng.getrandbits(48):012x}" for _ in range(rng.randint(2, 6))]
        newcomer = f"{rng.getrandbits(48):012x}"
        gone = rng.choice(ids)
        for strategy in joins:
            base = assign_buckets(table, ids, strategy)
            joins[strategy] += _moved(base, assign_buckets(table, ids + [newcomer], strategy))
            leaves[strategy] += _moved(base, assign_buckets(table, [i for i in ids if i != gone], strategy), gone)
    assert joins["rendezvous"] < 0.85 * joins["ranges"], joins
    assert leaves["rendezvous"] < 0.6 * leaves["ranges"], leaves


def test_rendezvous_removal_keeps_untouched_buckets_when_capacity_allows():
    # With more replicas than buckets each replica owns exactly one bucket (capacity 1): removing one
    # replica leaves every other bucket's owners untouched except where the removed one's slot moves.
    table = TWO
    rng = random.Random(1)
    for _ in range(100):
        ids = [f"{rng.getrandbits(48):012x}" for _ in range(5)]
        before = assign_buckets(table, ids, "rendezvous")
        gone = rng.choice(ids)
        after = assign_buckets(table, [i for i in ids if i != gone], "rendezvous")
        for key in table.keys:
            kept = set(before[key]) - {gone}
            assert len(kept & set(after[key])) >= len(kept) - 1  # at most one survivor re-balanced away
