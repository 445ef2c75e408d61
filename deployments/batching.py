"""`ContinuousBatcher`: merge whatever waits into the next batch when a batch slot frees; no timer.

Why not `@serve.batch` here: it forms a batch as soon as the previous one was *formed* (then waits for
a `max_concurrent_batches` slot), so under load its batches hold what arrived within
`batch_wait_timeout_s`, not what queued while the device was busy; and at idle every request pays the
wait. This batcher forms a batch only when a slot is free, from everything queued by then (within the
limits), so an idle request starts at once and a busy device gets full batches. The encoder replica
uses it with `pipeline_depth` slots (batches in flight on its device); the ingress merges one-image callers
with a few slots so that encoder calls overlap.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Protocol


class Sized(Protocol):
    """What the batcher reads of an item: its patches and its images (`len(counts)`)."""

    counts: Sequence[int]

    @property
    def patches(self) -> int: ...


def _cancel_if_abandoned(task: asyncio.Task, futures: list[asyncio.Future], _done: asyncio.Future) -> None:
    """Every caller of a running batch is gone (cancelled: deadline, disconnect): so is the batch."""
    if not task.done() and all(f.cancelled() for f in futures):
        task.cancel()


class ContinuousBatcher:
    """`await batcher(item)` -> the item's result from `run(batch)`.

    `run(items) -> results` runs one batch (one result per item, in order); `fits(patches, images)` says
    whether a batch of that size is allowed (a single item always runs, even alone above the limits);
    at most `max_concurrent` batches run at once. `keep(items) -> k` (optional) may shorten a formed
    batch to its first k items; the rest go back to the front of the queue, first in the next batch.
    An exception from `run` goes to every caller of that batch; callers cancelled while queued are
    dropped before the batch is formed (so are items for which `expired(item)`, optional, is true: their
    callers get TimeoutError), and a running batch whose callers were all cancelled is cancelled.
    """

    def __init__(
        self,
        run: Callable[[list[Any]], Awaitable[list]],
        fits: Callable[[int, int], bool],
        max_concurrent: int = 1,
        keep: Callable[[list[Any]], int] | None = None,
        expired: Callable[[Any], bool] | None = None,
    ):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self._run, self._fits, self._slots, self._keep, self._expired = run, fits, max_concurrent, keep, expired
        self._queue: deque[tuple[Sized, asyncio.Future]] = deque()
        self._running = 0
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def __call__(self, item: Sized):
        if self._running < self._slots and not self._queue:
            # a free slot and nobody waiting: a batch of this item alone, run in the caller's task (an idle
            # request skips the hand-off to a batch task and back; cancelling the caller cancels its batch)
            self._running += 1
            try:
                (result,) = await self._run([item])
            finally:
                self._running -= 1
                self._dispatch()
            return result
        future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._dispatch()
        return await future

    def _take(self) -> tuple[list, list[asyncio.Future]]:
        batch, futures, patches, images = [], [], 0, 0
        while self._queue:
            item, future = self._queue[0]
            if future.done():  # cancelled while waiting
                self._queue.popleft()
                continue
            if self._expired is not None and self._expired(item):  # nobody waits for it any more
                self._queue.popleft()
                future.set_exception(TimeoutError("the request's deadline passed while it was queued"))
                continue
            if batch and not self._fits(patches + item.patches, images + len(item.counts)):
                break
            self._queue.popleft()
            batch.append(item)
            futures.append(future)
            patches, images = patches + item.patches, images + len(item.counts)
        if self._keep is not None and len(batch) > 1:
            k = min(max(1, self._keep(batch)), len(batch))
            for item, future in zip(reversed(batch[k:]), reversed(futures[k:]), strict=True):
                self._queue.appendleft((item, future))
            del batch[k:], futures[k:]
        return batch, futures

    def _dispatch(self) -> None:
        while self._running < self._slots:
            batch, futures = self._take()
            if not batch:
                return
            self._running += 1
            task = asyncio.get_running_loop().create_task(self._run_batch(batch, futures))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            for f in futures:
                f.add_done_callback(partial(_cancel_if_abandoned, task, futures))

    async def _run_batch(self, batch: list, futures: list[asyncio.Future]) -> None:
        try:
            results = await self._run(batch)
        except BaseException as e:  # noqa: BLE001 - every caller of the batch gets the error
            error = e if isinstance(e, Exception) else RuntimeError(f"batch interrupted: {type(e).__name__}")
            for f in futures:
                if not f.done():
                    f.set_exception(error)
            if not isinstance(e, Exception):
                raise
        else:
            for f, r in zip(futures, results, strict=True):
                if not f.done():
                    f.set_result(r)
        finally:
            self._running -= 1
            self._dispatch()
