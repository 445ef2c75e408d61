"""Admission by cost, body deadlines and dropping abandoned work (issue 17), without a Ray cluster."""

from __future__ import annotations

import asyncio
import pickle
from functools import partial

import pytest

from deployments.aio import await_cancelling, gather_or_cancel
from deployments.batching import ContinuousBatcher
from deployments.errors import ErrorCode, RequestError, classify
from deployments.ingress.limits import Admission, OverCapacityError, Ticket, check_request_patches, read_body
from encoder.errors import DecodeTimeoutError, ImageTooComplexError


def test_byte_and_patch_budgets_refuse_at_once_and_release_together():
    gate = Admission(10, max_bytes=100, max_patches=50, retry_after_s=2)
    a, b = Ticket(), Ticket()
    gate.reserve_bytes(a, 150)  # alone: always let in, whatever its size
    with pytest.raises(OverCapacityError) as info:
        gate.reserve_bytes(b, 1)
    assert classify(info.value).error is ErrorCode.RATE_LIMITED and info.value.retry_after_s == 2
    assert "150 bytes of requests in flight, at its limit of 100" in str(info.value)
    gate.reserve_patches(a, 40)
    gate.reserve_patches(b, 10)
    with pytest.raises(OverCapacityError, match="patches"):
        gate.reserve_patches(b, 1)
    gate.enter(a)
    assert (gate.inflight, gate.bytes, gate.patches) == (1, 150, 50)
    gate.leave(a)
    gate.leave(b)
    assert (gate.inflight, gate.bytes, gate.patches) == (0, 0, 0)
    assert gate.snapshot()["rejected_bytes"] == 1 and gate.snapshot()["rejected_patches"] == 1


def test_a_request_alone_is_let_in_whatever_its_parts():
    """Broken: the request's own headers made it "not alone", so with `max_inflight_bytes` under
    `max_request_bytes` a big request got 429 at its body for ever, nothing else in flight."""
    gate = Admission(10, max_bytes=100, max_patches=50, retry_after_s=1)
    a, b = Ticket(), Ticket()
    for part in (300, 80, 80):  # its headers, then a body in chunks, each over what is left
        gate.reserve_bytes(a, part)
    gate.reserve_patches(a, 30)
    gate.reserve_patches(a, 40)
    assert (gate.bytes, gate.patches) == (460, 70)
    with pytest.raises(OverCapacityError):  # another request is not alone
        gate.reserve_bytes(b, 1)
    gate.leave(a)
    gate.reserve_bytes(b, 1)


def test_over_capacity_error_survives_pickling():
    e = pickle.loads(pickle.dumps(OverCapacityError("bytes of requests", 7, 5, 1.0)))
    assert (e.status_code, e.retry_after_s, str(e)) == (429, 1.0, OverCapacityError("bytes of requests", 7, 5).message)


def test_decode_errors_have_their_own_rows():
    assert classify(DecodeTimeoutError("x")).error is ErrorCode.IMAGE_DECODE_TIMEOUT
    assert classify(ImageTooComplexError("x")).error is ErrorCode.IMAGE_TOO_COMPLEX
    assert ErrorCode.IMAGE_DECODE_TIMEOUT.status == 413


class FakeRequest:
    def __init__(self, chunks, length=None, gap_s=0.0):
        self.headers = {} if length is None else {"content-length": str(length)}
        self._chunks, self._gap_s = chunks, gap_s

    async def stream(self):
        for c in self._chunks:
            if self._gap_s:
                await asyncio.sleep(self._gap_s)  # a slow client, simulated
            yield c


def test_read_body_reserves_bytes_and_enforces_its_deadline():
    reserved = []
    body = asyncio.run(read_body(FakeRequest([b"ab", b"cd"], 4), 10, reserved.append, 1.0))
    assert bytes(body) == b"abcd" and reserved == [2, 2]  # as it arrives, whatever the Content-Length says
    reserved.clear()
    assert bytes(asyncio.run(read_body(FakeRequest([b"ab", b"cd"]), 10, reserved.append))) == b"abcd"
    assert reserved == [2, 2]  # chunked: as it arrives
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(FakeRequest([b"a"] * 10, 10, gap_s=0.05), 10, None, 0.2, min_rate=1000))
    assert info.value.error is ErrorCode.REQUEST_TIMEOUT and "did not arrive in time" in str(info.value)


def test_a_batch_whose_callers_are_all_gone_is_cancelled():
    class Item:
        def __init__(self):
            self.counts = [1]

        @property
        def patches(self):
            return 1

    async def main():
        started, cancelled = asyncio.Event(), []

        async def run(items):
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(len(items))
                raise

        batcher = ContinuousBatcher(run, lambda p, i: True, max_concurrent=1)
        first = asyncio.ensure_future(batcher(Item()))  # runs in its own task
        await started.wait()
        queued = [asyncio.ensure_future(batcher(Item())) for _ in range(2)]
        await asyncio.sleep(0)
        first.cancel()  # the slot frees: the two queued ones form the next batch
        started.clear()
        await started.wait()
        for q in queued:
            q.cancel()
        await asyncio.gather(first, *queued, return_exceptions=True)
        await asyncio.sleep(0)
        # a copy, taken now: `asyncio.run` cancels whatever task is still running when `main` returns, and that
        # would append the batch the batcher failed to cancel to the list itself (the test could not fail)
        return list(cancelled)

    assert asyncio.run(main()) == [1, 2]


def test_gather_or_cancel_and_await_cancelling():
    async def main():
        never = asyncio.Event()
        cancelled = []

        async def fails():
            raise ValueError("bad")

        async def waits():
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        with pytest.raises(ValueError):
            await gather_or_cancel([fails(), waits()])
        await asyncio.sleep(0)

        class Response:
            cancelled = False

            def __await__(self):
                return never.wait().__await__()

            def cancel(self):
                self.cancelled = True

        r = Response()
        task = asyncio.ensure_future(await_cancelling(r))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return cancelled, r.cancelled

    assert asyncio.run(main()) == ([True], True)


def test_queued_work_past_its_deadline_is_dropped_unrun():
    class Item:
        counts = [1]
        patches = 1

        def __init__(self, expired: bool):
            self.expired = expired

    async def main():
        started, release, ran = asyncio.Event(), asyncio.Event(), []

        async def run(items):
            ran.append(len(items))
            started.set()
            await release.wait()
            return [len(items)] * len(items)

        batcher = ContinuousBatcher(run, lambda p, i: True, max_concurrent=1, expired=lambda item: item.expired)
        first = asyncio.ensure_future(batcher(Item(False)))
        await started.wait()
        late, fresh = asyncio.ensure_future(batcher(Item(True))), asyncio.ensure_future(batcher(Item(False)))
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(first, late, fresh, return_exceptions=True)
        return results, ran

    (first, late, fresh), ran = asyncio.run(main())
    assert isinstance(late, TimeoutError) and "deadline passed" in str(late)
    assert (first, fresh, ran) == (1, 1, [1, 1])  # the expired item never ran


def test_limits_are_inclusive_a_request_exactly_at_one_is_let_in():
    """Every limit is "at most": a request of exactly `max_request_patches` patches, a body of exactly
    `max_request_bytes` (chunked, no Content-Length) and bytes that bring the replica exactly to
    `max_inflight_bytes` are let in; one more is refused."""
    check_request_patches(4096, 4096)
    with pytest.raises(RequestError) as info:
        check_request_patches(4097, 4096)
    assert info.value.error is ErrorCode.TOO_MANY_PATCHES
    assert bytes(asyncio.run(read_body(FakeRequest([b"abcd", b"ef"]), 6))) == b"abcdef"
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(FakeRequest([b"abcd", b"efg"]), 6))
    assert info.value.error is ErrorCode.REQUEST_TOO_LARGE
    gate = Admission(10, max_bytes=100)
    a, b = Ticket(), Ticket()
    gate.reserve_bytes(a, 60)
    gate.reserve_bytes(b, 40)  # 100 of 100: in
    with pytest.raises(OverCapacityError):
        gate.reserve_bytes(b, 1)
    assert (gate.bytes, gate.rejected_bytes) == (100, 1)


def test_a_chunked_bodys_deadline_grows_with_what_has_arrived():
    """Without a Content-Length the body's deadline is `timeout_s` plus 1 s per `min_rate` bytes received so far: a
    steady client sending 10 bytes every 50 ms (far above 10 bytes/s) is not cut off at `timeout_s`."""
    body = asyncio.run(read_body(FakeRequest([b"x" * 10] * 6, gap_s=0.05), 100, None, timeout_s=0.1, min_rate=10))
    assert len(body) == 60


class StalledRequest:
    """A client that declares `length` bytes, sends one and then nothing; `sent` is set once that byte is out."""

    def __init__(self, length: int):
        self.headers = {"content-length": str(length)}
        self.sent, self._never = asyncio.Event(), asyncio.Event()

    async def stream(self):
        yield b"{"
        self.sent.set()
        await self._never.wait()
        yield b""


def test_declared_sizes_hold_no_bytes_and_no_time_only_what_arrived_does():
    """Four clients declaring 64 MiB and sending one byte: the byte budget holds 4 bytes, so a small request is
    let in (reserving the declared size refused every other request 429 for a minute), and each stalled body
    is 408 after `timeout_s`, not `timeout_s` + 64 s."""
    declared = 64 * 2**20

    async def main():
        gate = Admission(10, max_bytes=256 * 2**20)
        stalled = [StalledRequest(declared) for _ in range(4)]
        tasks = [
            asyncio.create_task(read_body(r, declared, partial(gate.reserve_bytes, Ticket()), 0.2, 2**20))
            for r in stalled
        ]
        for r in stalled:
            await r.sent.wait()
        assert gate.bytes == 4
        body = await read_body(FakeRequest([b"x" * 1000], 1000), declared, partial(gate.reserve_bytes, Ticket()))
        assert len(body) == 1000  # let in: no 429
        async with asyncio.timeout(10):  # the deadline is 0.2 s + 1 byte / 1 MiB/s; the declared size would add 64 s
            results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(e, RequestError) and e.error is ErrorCode.REQUEST_TIMEOUT for e in results), results

    asyncio.run(main())
