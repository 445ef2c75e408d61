"""Text requests through the `BucketRouter` (Ray's real routing loop, fake replicas: `tests/router_fakes.py`): they
carry `num_tokens` / `num_texts`, not patches, belong to no image bucket, go to the shortest queue of the
replicas not saturated, and their tokens count in the router's in-flight work."""

from __future__ import annotations

from deployments.routing.assignment import text_size
from deployments.routing.stats import BucketRoutingStats
from tests.router_fakes import TWO, FakeReplica, FakeResult, make_router, request, route, run, settle, two_replicas


def test_text_size_reads_tokens_and_texts_only():
    async def body():
        assert text_size(request(num_tokens=154, num_texts=2)) == (154, 2)
        assert text_size(request(num_tokens=77)) == (77, 1)
        assert text_size(request(200)) is None  # an image request
        assert text_size(request(num_tokens=0, num_texts=1)) is None
        assert text_size(request(num_tokens=True)) is None
        assert text_size(None) is None

    run(body())


def test_texts_go_to_the_shortest_queue_whatever_owns_the_buckets():
    async def body():
        router = make_router(spill_queue_len=100, spill_patches=0)
        a, b = await two_replicas(router, max_ongoing=100)
        a.queue_len = 3  # a owns the small bucket; with images queued there a text goes to b
        router.on_new_queue_len_info(a.replica_id, 3)
        chosen = [(await route(router, num_tokens=77, num_texts=1)).uid for _ in range(5)]
        assert chosen[:3] == ["b"] * 3  # b until the queues are level, then either
        assert abs(a.queue_len - b.queue_len) <= 1
        assert (await route(router, 200)).uid == "a"  # images keep their owner

    run(body())


def test_a_saturated_replica_gets_texts_last_and_their_tokens_count_in_flight():
    async def body():
        router = make_router(spill_queue_len=100, spill_patches=1000)
        a, b = await two_replicas(router, max_ongoing=100)
        results = []
        for _ in range(2):  # two text calls of 616 tokens each on a: 1232 >= 1000, a is saturated
            pr = request(num_tokens=616, num_texts=8)
            results.append(FakeResult())
            router.on_request_routed(pr, a.replica_id, results[-1])
        assert router.inflight_patches(a.replica_id) == 1232
        b.queue_len = 5  # b's queue is longer, but a is saturated: b first
        router.on_new_queue_len_info(b.replica_id, 5)
        assert (await route(router, num_tokens=77, num_texts=1)).uid == "b"
        for result in results:
            result.finish()
        await settle(router)  # the release hops through the loop
        assert router.inflight_patches(a.replica_id) == 0
        assert (await route(router, num_tokens=77, num_texts=1)).uid == "a"  # the shorter queue again

    run(body())


def test_not_ready_replicas_get_texts_last():
    async def body():
        router = make_router()
        ready = FakeReplica("b", BucketRoutingStats.from_table(TWO).to_dict(), max_ongoing=10, queue_len=3)
        not_ready = FakeReplica("a", BucketRoutingStats.from_table(TWO, ready=False).to_dict(), max_ongoing=10)
        router.update_replicas([ready, not_ready])
        await settle(router)
        for _ in range(3):
            assert (await route(router, num_tokens=77, num_texts=1)).uid == "b"

    run(body())
