"""Which encoder replicas make progress, judged from outside them (issue 44: a hung replica).

A replica whose process is frozen (SIGSTOP, a wedged driver call holding the GIL) cannot report itself: its actor
lives, so Serve's status, the GCS and the ingress's `/health` all call it running, and Serve's health check gives up
on it only after `health_check_timeout_s` (measured: replaced ~95 s after the freeze). Meanwhile every call routed to
it waits out the request's deadline, and the ingress's merge slots wait with them, so a healthy second replica idles.

So the caller judges. `ReplicaProgress` (one per application in each process that calls the encoder,
`progress_for(app_name)`) is told by the ingress when an encoder call starts and ends (`begin`, `end`) and by the
router which replica each call was given to (`assigned`), and records the router's liveness probes of replicas
that have been quiet (`probe_sent`, `probe_answered`). A replica is **stalled** when

* a call given to it has waited longer than `stall_timeout_s` and no call to it was answered in that time, or
* a probe of it is unanswered, sent at least half of `stall_timeout_s` ago, and nothing came back from it for
  `stall_timeout_s` (no traffic needed: `/health` notices an idle frozen replica too).

The stall timeout must exceed the longest legitimate batch: a replica answering any call within it is never stalled,
however long its queue. Stalled is sticky: it ends when a call to the replica is answered, or when a probe is
answered and no call given to it has been waiting longer than the timeout (the process runs again, SIGCONT; a
replica whose event loop answers while its device thread is stuck is judged stalled again by its next calls).

What reads it: the router leaves stalled replicas out (`BucketRouter.choose_replicas`), the ingress gives up calls
waiting on a stalled replica and retries them elsewhere, and fails fast while no replica makes progress
(`ingress.encoder_calls`), and `/health` counts stalled replicas as not serving (`ingress.readiness`). Thread-safe:
the router may run on a loop of its own thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ray.serve.exceptions import ReplicaUnavailableError

DEFAULT_STALL_TIMEOUT_S = 3.0


class ReplicaStalledError(ReplicaUnavailableError):
    """An encoder call given up because its replica (or every replica) stopped making progress. A
    `ReplicaUnavailableError`, so the ingress retries it elsewhere and, once retries run out, answers 503
    `encoder_unavailable` (`deployments.errors`)."""

    def __init__(self, reason: str, replica_id: str = ""):
        super().__init__(replica_id)
        self.reason = reason

    @property
    def message(self) -> str:
        return self.reason

    def __str__(self) -> str:
        return self.reason


@dataclass
class _Replica:
    progress_at: float  # a call to it was last answered (or it was first seen)
    alive_at: float  # anything came back from it: an answered call or probe
    stalled_at: float | None = None
    probe_sent_at: float | None = None  # the probe now unanswered, if any
    waiting: dict[str, float] = field(default_factory=dict)  # call id -> when it was given to this replica


class ReplicaProgress:
    """Progress of the encoder replicas as one process sees it (see the module docstring). `clock`: for tests."""

    def __init__(self, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self.stall_timeout_s = stall_timeout_s
        self._replicas: dict[str, _Replica] = {}
        self._calls: dict[str, str | None] = {}  # call id -> replica it was given to (None: not yet)

    def configure(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s

    # -- what the router and the ingress report ------------------------------------------------------------
    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """The replicas that may be routed to now; others are forgotten, new ones start with a clean record."""
        with self._lock:
            now, ids = self._clock(), set(replica_ids)
            for rid in [rid for rid in self._replicas if rid not in ids]:
                del self._replicas[rid]
            for rid in ids - self._replicas.keys():
                self._replicas[rid] = _Replica(progress_at=now, alive_at=now)

    def begin(self, call_id: str) -> None:
        """The ingress is about to send a call with this (internal request) id."""
        with self._lock:
            self._calls[call_id] = None

    def assigned(self, call_id: str, replica_id: str) -> None:
        """The router gave the call to a replica (again, after a rejection: the last one counts). Calls this
        process's caller did not `begin` (or already ended) are not tracked."""
        with self._lock:
            if call_id not in self._calls:
                return
            previous = self._calls[call_id]
            if previous is not None and previous in self._replicas:
                self._replicas[previous].waiting.pop(call_id, None)
            self._calls[call_id] = replica_id
            replica = self._replicas.get(replica_id)
            if replica is not None:
                replica.waiting[call_id] = self._clock()

    def end(self, call_id: str, answered: bool) -> None:
        """The call is over. `answered`: the replica answered it (a result or an error of its own), which is
        progress; not when it was cancelled, given up, or its replica died."""
        with self._lock:
            rid = self._calls.pop(call_id, None)
            replica = self._replicas.get(rid) if rid is not None else None
            if replica is None:
                return
            replica.waiting.pop(call_id, None)
            if answered:
                now = self._clock()
                replica.progress_at = replica.alive_at = now
                replica.stalled_at = None

    def probe_due(self, replica_id: str) -> bool:
        """Whether the router should probe the replica now: none of its probes is pending and nothing came back
        from it for a quarter of the stall timeout."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None or replica.probe_sent_at is not None:
                return False
            return self._clock() - replica.alive_at >= self.stall_timeout_s / 4

    def probe_sent(self, replica_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None:
                replica.probe_sent_at = self._clock()

    def probe_answered(self, replica_id: str) -> None:
        """The replica's process answered: it runs. A stall ends unless a call given to it still waits too long."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None:
                return
            now = self._clock()
            replica.alive_at, replica.probe_sent_at = now, None
            oldest = min(replica.waiting.values(), default=now)
            if now - max(oldest, replica.progress_at) <= self.stall_timeout_s:
                replica.stalled_at = None

    def probe_failed(self, replica_id: str) -> None:
        """The probe ended without an answer (the replica died, or the probe was cancelled): no evidence."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None:
                replica.probe_sent_at = None

    # -- judgements -------------------------------------------------------------------------------------------
    def _judge(self, replica: _Replica, now: float) -> bool:
        if replica.stalled_at is not None:
            return True
        timeout = self.stall_timeout_s
        oldest = min(replica.waiting.values(), default=None)
        calls_stuck = oldest is not None and now - max(oldest, replica.progress_at) > timeout
        probe = replica.probe_sent_at
        probe_stuck = probe is not None and now - probe >= timeout / 2 and now - replica.alive_at > timeout
        if calls_stuck or probe_stuck:
            replica.stalled_at = now
        return replica.stalled_at is not None

    def stalled(self, replica_id: str) -> bool:
        with self._lock:
            replica = self._replicas.get(replica_id)
            return replica is not None and self._judge(replica, self._clock())

    def stalled_replicas(self) -> dict[str, float]:
        """Stalled replicas and how long each has been silent (seconds since anything came back from it)."""
        with self._lock:
            now = self._clock()
            return {
                rid: round(now - r.alive_at, 1) for rid, r in self._replicas.items() if self._judge(r, now)
            }  # fmt: skip

    def replica_count(self) -> int:
        with self._lock:
            return len(self._replicas)

    def _no_progress(self, now: float) -> bool:
        return bool(self._replicas) and all(self._judge(r, now) for r in self._replicas.values())

    def no_progress(self) -> bool:
        """Replicas are known and every one of them is stalled: a call sent now would only wait."""
        with self._lock:
            return self._no_progress(self._clock())

    def verdict(self, call_id: str) -> ReplicaStalledError | None:
        """Why the call should be given up now, or None: its replica is stalled, or it is not given to a replica
        yet while none makes progress."""
        with self._lock:
            if call_id not in self._calls:
                return None
            now, rid = self._clock(), self._calls[call_id]
            if rid is None:
                if self._no_progress(now):
                    return ReplicaStalledError(no_progress_message(len(self._replicas), self.stall_timeout_s))
                return None
            replica = self._replicas.get(rid)
            if replica is None or not self._judge(replica, now):
                return None
            silent = now - replica.alive_at
            return ReplicaStalledError(
                f"encoder replica {rid} made no progress for {silent:.1f}s (stall timeout {self.stall_timeout_s:g}s); "
                "the call was given up to be retried elsewhere",
                rid,
            )

    def tracked_calls(self) -> int:
        with self._lock:
            return len(self._calls)


def no_progress_message(replicas: int, timeout_s: float) -> str:
    return f"no encoder replica made progress within the stall timeout ({timeout_s:g}s; {replicas} replica(s) stalled)"


_REGISTRY: dict[str, ReplicaProgress] = {}
_REGISTRY_LOCK = threading.Lock()


def progress_for(app_name: str, create: bool = True) -> ReplicaProgress | None:
    """The process's `ReplicaProgress` of the application's encoder replicas (made on first use when `create`):
    the router of the encoder handle and the ingress that calls it share it."""
    with _REGISTRY_LOCK:
        progress = _REGISTRY.get(app_name)
        if progress is None and create:
            progress = _REGISTRY[app_name] = ReplicaProgress()
        return progress
