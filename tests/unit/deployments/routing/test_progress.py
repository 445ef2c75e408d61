"""Unit tests for deployments.routing.progress (issue 44, a hung replica), on a fake clock and without Ray: when a
replica is judged stalled from the calls and probes sent to it, that the judgement sticks and when it ends, what the
ingress is told to give up; and the ingress's `StallWatch` giving up a call on a stalled replica exactly once."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from deployments.errors import ErrorCode, classify
from deployments.routing.progress import ReplicaProgress, ReplicaStalledError, progress_for


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def progress(clock) -> ReplicaProgress:
    p = ReplicaProgress(stall_timeout_s=3.0, clock=clock)
    p.set_replicas(["a", "b"])
    return p


def send(progress: ReplicaProgress, call: str, replica: str) -> None:
    progress.begin(call)
    progress.assigned(call, replica)


def test_a_call_unanswered_past_the_timeout_stalls_its_replica_only(progress, clock):
    send(progress, "c1", "a")
    clock.now += 2.9
    assert not progress.stalled("a") and progress.verdict("c1") is None
    clock.now += 0.2
    assert progress.stalled("a") and not progress.stalled("b")
    error = progress.verdict("c1")
    assert isinstance(error, ReplicaStalledError) and "a made no progress" in str(error)
    assert not progress.no_progress()
    assert progress.stalled_replicas() == {"a": 3.1}


def test_a_replica_answering_other_calls_is_not_stalled_however_long_one_waits(progress, clock):
    send(progress, "big", "a")
    for i in range(10):  # a long queue: one call waits 10 s, but something is answered every second
        clock.now += 1.0
        send(progress, f"c{i}", "a")
        progress.end(f"c{i}", answered=True)
    assert not progress.stalled("a") and progress.verdict("big") is None


def test_the_stall_sticks_after_the_calls_are_given_up_until_the_replica_answers(progress, clock):
    send(progress, "c1", "a")
    clock.now += 3.5
    assert progress.stalled("a")
    progress.end("c1", answered=False)  # the ingress gave it up (cancelled): no evidence of progress
    clock.now += 10
    assert progress.stalled("a")  # no call waits on it now, but nothing came back either
    progress.probe_sent("a")
    clock.now += 1
    progress.probe_answered("a")  # SIGCONT: the process answers again
    assert not progress.stalled("a")


def test_a_probe_answer_does_not_end_a_stall_while_a_call_still_waits_too_long(progress, clock):
    send(progress, "c1", "a")
    clock.now += 3.5
    assert progress.stalled("a")
    progress.probe_sent("a")
    progress.probe_answered("a")  # its event loop answers, its device thread does not
    assert progress.stalled("a")
    progress.end("c1", answered=True)  # the call itself is answered: progress
    assert not progress.stalled("a")


def test_an_idle_frozen_replica_is_found_by_its_unanswered_probe(progress, clock):
    assert not progress.probe_due("a")  # just seen
    clock.now += 0.8
    assert progress.probe_due("a")
    progress.probe_sent("a")
    assert not progress.probe_due("a")  # one probe at a time
    clock.now += 2.3  # 3.1 s since anything came back, the probe 2.3 s old
    assert progress.stalled("a")
    assert progress.stalled_replicas() == {"a": 3.1}


def test_a_fresh_probe_alone_does_not_stall(progress, clock):
    clock.now += 10  # idle, nothing probed it (no probe loop yet)
    progress.probe_sent("a")
    clock.now += 1.0  # nothing back for 11 s, but the probe had only 1 s
    assert not progress.stalled("a")
    clock.now += 0.6
    assert progress.stalled("a")


def test_a_failed_probe_is_no_evidence(progress, clock):
    progress.probe_sent("a")
    progress.probe_failed("a")  # died, or cancelled
    clock.now += 10
    assert not progress.stalled("a")


def test_no_progress_when_every_replica_is_stalled_and_unassigned_calls_are_given_up(progress, clock):
    progress.begin("waiting")  # not given to a replica yet (queued in the router)
    send(progress, "c1", "a")
    send(progress, "c2", "b")
    clock.now += 3.5
    assert progress.no_progress()
    assert "no encoder replica made progress" in str(progress.verdict("waiting"))
    progress.set_replicas(["b", "c"])  # a replaced: the replacement starts with a clean record
    assert not progress.no_progress() and progress.verdict("waiting") is None


def test_reassignment_after_a_rejection_moves_the_call(progress, clock):
    send(progress, "c1", "a")
    clock.now += 2
    progress.assigned("c1", "b")
    clock.now += 2
    assert not progress.stalled("a") and not progress.stalled("b")
    clock.now += 1.5
    assert progress.stalled("b") and not progress.stalled("a")


def test_calls_not_begun_here_or_already_ended_are_not_tracked(progress, clock):
    progress.assigned("someone-else", "a")
    send(progress, "c1", "a")
    progress.end("c1", answered=True)
    progress.assigned("c1", "a")  # a late assignment of an ended call
    clock.now += 10
    assert not progress.stalled("a") and progress.tracked_calls() == 0


def test_the_error_is_a_503_retried_as_an_unavailable_replica_and_pickles():
    error = ReplicaStalledError("replica r made no progress", "r")
    assert classify(error).error is ErrorCode.ENCODER_UNAVAILABLE
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == "replica r made no progress" and isinstance(copy, ReplicaStalledError)


def test_one_record_per_application():
    assert progress_for("unit-app") is progress_for("unit-app")
    assert progress_for("unit-other", create=False) is None


# -- the ingress side: StallWatch -----------------------------------------------------------------------------


class FakeResponse:
    """A handle call that never answers until `answer` is set, and records cancellation."""

    def __init__(self):
        self.future: asyncio.Future | None = None
        self.cancelled = 0

    def __await__(self):
        self.future = asyncio.get_running_loop().create_future()
        return self.future.__await__()

    def cancel(self):
        self.cancelled += 1
        if self.future is not None:
            self.future.cancel()


def test_stall_watch_gives_up_a_call_on_a_stalled_replica_once(monkeypatch):
    from deployments.ingress import encoder_calls

    async def main():
        progress = ReplicaProgress(stall_timeout_s=0.4)
        progress.set_replicas(["a", "b"])
        responses: list[FakeResponse] = []

        def fake_call(call_id, method, *args, **kwargs):
            progress.assigned(call_id, "a")  # what the router reports
            responses.append(FakeResponse())
            return responses[-1]

        monkeypatch.setattr(encoder_calls, "call_with_request_id", fake_call)
        watch = encoder_calls.StallWatch(progress)
        with pytest.raises(ReplicaStalledError, match="a made no progress"):
            await asyncio.wait_for(watch.call(None), timeout=5)
        assert responses[0].cancelled == 1 and progress.tracked_calls() == 0
        assert progress.stalled("a")  # giving up is not progress
        # every replica stalled: the next call fails at once, without being sent
        progress.begin("x")
        progress.assigned("x", "b")
        await asyncio.sleep(0.5)
        with pytest.raises(ReplicaStalledError, match="no encoder replica made progress"):
            await watch.call(None)
        assert len(responses) == 1

    asyncio.run(main())


def test_stall_watch_answers_are_progress_and_errors_of_the_replica_too(monkeypatch):
    from deployments.ingress import encoder_calls

    async def main():
        progress = ReplicaProgress(stall_timeout_s=0.4)
        progress.set_replicas(["a"])

        async def answer(value):
            await asyncio.sleep(0)
            if isinstance(value, BaseException):
                raise value
            return value

        outcomes = iter([[1.0], ValueError("bad input")])

        def fake_call(call_id, method, *args, **kwargs):
            progress.assigned(call_id, "a")
            return answer(next(outcomes))

        monkeypatch.setattr(encoder_calls, "call_with_request_id", fake_call)
        watch = encoder_calls.StallWatch(progress)
        assert await watch.call(None) == [1.0]
        with pytest.raises(ValueError):
            await watch.call(None)
        assert progress.tracked_calls() == 0 and not progress.stalled("a")

    asyncio.run(main())
