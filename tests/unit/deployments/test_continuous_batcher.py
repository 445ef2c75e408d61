"""`deployments.batching.ContinuousBatcher`, the replica's request merger, without Serve: waiting requests merge
within the patch and image limits, errors reach their callers, cancelled calls are skipped, up to
`max_concurrent_batches` run at once, and an idle call runs in its caller's task."""

from __future__ import annotations

import asyncio

import numpy as np

from deployments.batching import ContinuousBatcher
from deployments.wire import EncodeRequest
from encoder.errors import InvalidArgumentError


def _work(patches: int, images: int = 1, tag: str = "") -> EncodeRequest:
    return EncodeRequest([np.zeros((1, 1, 3), np.uint8)] * images, [patches // images] * images, tag or "mean")


def test_continuous_batcher_merges_waiting_requests_within_limits():
    batches: list[list[int]] = []

    async def run(works):
        batches.append([w.patches for w in works])
        await asyncio.sleep(0.01)  # the "device" is busy: later arrivals queue up
        return [w.patches for w in works]

    async def scenario():
        batcher = ContinuousBatcher(run, lambda p, n: p <= 1000 and n <= 3)
        first = asyncio.create_task(batcher(_work(100)))
        await asyncio.sleep(0)  # the first request starts alone: no idle wait
        rest = [asyncio.create_task(batcher(_work(100 * (i + 2)))) for i in range(5)]
        return await asyncio.gather(first, *rest)

    results = asyncio.run(scenario())
    assert results == [100, 200, 300, 400, 500, 600]
    assert batches[0] == [100]
    assert all(sum(b) <= 1000 and len(b) <= 3 for b in batches)
    assert sorted(p for b in batches for p in b) == results and len(batches) < len(results)


def test_continuous_batcher_propagates_errors_and_skips_cancelled():
    seen: list[int] = []

    async def run(works):
        seen.extend(w.patches for w in works)
        await asyncio.sleep(0.01)
        if any(w.pooling == "boom" for w in works):
            raise InvalidArgumentError("boom")
        return [w.patches for w in works]

    async def scenario():
        batcher = ContinuousBatcher(run, lambda p, n: n <= 1)
        a = asyncio.create_task(batcher(_work(1, tag="boom")))
        await asyncio.sleep(0)
        b = asyncio.create_task(batcher(_work(2)))
        c = asyncio.create_task(batcher(_work(3)))
        await asyncio.sleep(0)
        b.cancel()
        results = await asyncio.gather(a, c, return_exceptions=True)
        return results

    a, c = asyncio.run(scenario())
    assert isinstance(a, InvalidArgumentError) and c == 3 and 2 not in seen


def test_every_caller_of_a_failed_merged_batch_gets_its_error():
    """Three waiting callers merge into one batch that fails: each gets the exception (a batcher that gave it to
    the first and None to the others would pass the one-item batches above)."""
    release, batches = asyncio.Event(), []

    async def run(works):
        batches.append([w.patches for w in works])
        if len(batches) == 1:
            await release.wait()  # the device is busy: the next three queue up and merge
            return [w.patches for w in works]
        raise InvalidArgumentError("boom")

    async def scenario():
        batcher = ContinuousBatcher(run, lambda p, n: n <= 3, max_concurrent=1)
        first = asyncio.create_task(batcher(_work(1)))
        await asyncio.sleep(0)
        merged = [asyncio.create_task(batcher(_work(p))) for p in (2, 3, 4)]
        await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(first, *merged, return_exceptions=True)

    first, *merged = asyncio.run(scenario())
    assert first == 1 and batches == [[1], [2, 3, 4]]
    assert all(isinstance(m, InvalidArgumentError) and str(m) == "boom" for m in merged), merged


def test_continuous_batcher_runs_up_to_max_concurrent_batches_and_merges_the_rest():
    running, peak, batches = 0, 0, []
    release, two_running = asyncio.Event(), asyncio.Event()

    async def run(works):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 2:
            two_running.set()
        batches.append([w.patches for w in works])
        await release.wait()
        running -= 1
        return [-w.patches for w in works]

    async def scenario():
        batcher = ContinuousBatcher(run, lambda p, n: n <= 4, max_concurrent=2)
        first = [asyncio.create_task(batcher(_work(i + 1))) for i in range(2)]
        await asyncio.wait_for(two_running.wait(), 5)  # both start at once, each alone: two free slots
        assert batches == [[1], [2]] and batcher.queued == 0
        rest = [asyncio.create_task(batcher(_work(i + 3))) for i in range(6)]
        await asyncio.sleep(0)
        assert batcher.queued == 6 and len(batches) == 2  # both slots busy: the others wait
        release.set()
        return await asyncio.gather(*first, *rest)

    assert asyncio.run(scenario()) == [-(i + 1) for i in range(8)]
    assert peak == 2
    assert batches[2:] == [[3, 4, 5, 6], [7, 8]]  # freed slots took what waited, up to 4 images each


def test_continuous_batcher_keep_leaves_the_rest_first_in_line():
    batches: list[list[int]] = []

    async def run(works):
        batches.append([w.patches for w in works])
        await asyncio.sleep(0.01)
        return [w.patches for w in works]

    async def scenario():
        # keep at most 2 of a formed batch; the limit alone would allow 10
        batcher = ContinuousBatcher(run, lambda p, n: n <= 10, keep=lambda works: 2)
        first = asyncio.create_task(batcher(_work(1)))
        await asyncio.sleep(0)
        rest = [asyncio.create_task(batcher(_work(i + 2))) for i in range(5)]
        return await asyncio.gather(first, *rest)

    assert asyncio.run(scenario()) == [1, 2, 3, 4, 5, 6]
    assert batches == [[1], [2, 3], [4, 5], [6]]  # order kept: the trimmed requests lead the next batch


def test_continuous_batcher_runs_an_idle_call_in_the_callers_task():
    """With a free slot and nothing queued, the item is a batch of its own run in the caller's task (no hand-off
    to a batch task); calls that arrive meanwhile still queue and merge in the other slot."""
    tasks: list[tuple[asyncio.Task | None, list[int]]] = []
    release = None

    async def run(works):
        tasks.append((asyncio.current_task(), [w.patches for w in works]))
        await release.wait()
        return [w.patches * 10 for w in works]

    async def scenario():
        nonlocal release
        release = asyncio.Event()
        batcher = ContinuousBatcher(run, lambda p, n: n <= 8, max_concurrent=2)
        first = asyncio.create_task(batcher(_work(1)))
        await asyncio.sleep(0)  # first runs inline and waits; slot 2 is free
        second = asyncio.create_task(batcher(_work(2)))  # inline in its own task too (a free slot, no queue)
        await asyncio.sleep(0)
        rest = [asyncio.create_task(batcher(_work(3 + i))) for i in range(3)]  # both slots busy: queued
        await asyncio.sleep(0)
        queued = batcher.queued
        release.set()
        out = await asyncio.gather(first, second, *rest)
        return first, second, queued, out

    first, second, queued, out = asyncio.run(scenario())
    assert out == [10, 20, 30, 40, 50]
    assert queued == 3
    assert tasks[0] == (first, [1]) and tasks[1] == (second, [2])
    assert tasks[2][1] == [3, 4, 5] and tasks[2][0] not in (first, second)  # merged in a batch task


def test_a_running_batch_keeps_running_for_the_callers_still_waiting():
    """One caller of a merged batch going away (its deadline, a disconnect) must not cancel the batch under the
    others: only a batch whose callers are all gone is cancelled."""
    batches: list[list[int]] = []
    started: list[asyncio.Event] = []
    gates: list[asyncio.Event] = []

    async def run(works):
        i = len(batches)
        batches.append([w.patches for w in works])
        started[i].set()
        await gates[i].wait()
        return [w.patches for w in works]

    async def scenario():
        started[:], gates[:] = [asyncio.Event() for _ in range(2)], [asyncio.Event() for _ in range(2)]
        batcher = ContinuousBatcher(run, lambda p, n: n <= 4, max_concurrent=1)
        first = asyncio.create_task(batcher(_work(1)))
        await started[0].wait()
        gone, staying = asyncio.create_task(batcher(_work(2))), asyncio.create_task(batcher(_work(3)))
        gates[0].set()  # the two queue (their tasks run before the first batch resumes), then merge
        await started[1].wait()
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        gates[1].set()
        return await first, await staying

    assert asyncio.run(scenario()) == (1, 3)
    assert batches == [[1], [2, 3]]
