"""Health semantics, the drain's admission rule and echoed values (issue 17, items 5, 6, 9). No Ray cluster."""

from __future__ import annotations

import time
from types import SimpleNamespace

from deployments.errors import ErrorCode, RequestError, shown
from deployments.ingress.openai_api import error_response
from deployments.ingress.readiness import encoder_ready
from deployments.shutdown import GRACE_S, QUIET_GRACE_S, SHUTDOWN_MARGIN_S, DrainWatch, drain_timeout


def status(running: int, state: str = "HEALTHY"):
    dep = SimpleNamespace(status=state, replica_states={"RUNNING": running})
    return SimpleNamespace(applications={"v": SimpleNamespace(deployments={"VisionEncoder": dep})})


def test_health_counts_live_replicas_not_serves_lagging_view():
    # Serve still says 2 running, the GCS knows one alive: ready, degraded
    ready, detail = encoder_ready(status(2, "UNHEALTHY"), "v", live=1, total=2)
    assert ready and detail["status"] == "degraded" and detail["encoder_replicas"] == {"serving": 1, "total": 2}
    # the only replica's actor is gone though Serve has not noticed: not ready
    ready, detail = encoder_ready(status(1), "v", live=0, total=1)
    assert not ready and detail["status"] == "unavailable"
    # a replacement actor exists but is not running yet: not ready
    assert not encoder_ready(status(0, "UNHEALTHY"), "v", live=1, total=1)[0]
    ready, detail = encoder_ready(status(2), "v", live=2, total=2)
    assert ready and detail["status"] == "ok"
    # an autoscaled deployment (or a config file's num_replicas) runs more than the arguments' num_replicas: Serve's
    # count is the total (broken: "3 of 1", and "2 of 1" still "ok" with one of three replicas dead)
    ready, detail = encoder_ready(status(3), "v", live=2, total=1)
    assert ready and detail["status"] == "degraded" and detail["encoder_replicas"] == {"serving": 2, "total": 3}


def test_every_error_code_has_a_string_outcome():
    # a name inside the Enum body once referred to the member, not the outcome string (a KeyError -> 500)
    assert all(isinstance(e.outcome, str) for e in ErrorCode)


def test_shutting_down_is_503_with_retry_after():
    r = error_response(RequestError("the service is shutting down", ErrorCode.SHUTTING_DOWN, None), 2)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert b'"code":"shutting_down"' in r.body and b"RequestError" not in r.body


def test_shown_truncates_echoed_values():
    assert shown("tiny") == "'tiny'"
    long = shown("x" * 1_000_000)
    assert len(long) < 110 and long.endswith("…'")


def test_drain_watch_admits_only_within_the_grace():
    inflight = [0]
    watches = []

    def watch(grace_s: float = GRACE_S) -> DrainWatch:
        watches.append(DrainWatch("r1", lambda: inflight[0], poll_s=60, grace_s=grace_s))  # driven by hand
        return watches[-1]

    try:
        # a replica that has seen no request: the short grace
        idle = watch()
        assert not idle.draining and idle.notice(time.monotonic()) == QUIET_GRACE_S < GRACE_S
        assert idle.draining and idle.admitting()
        idle.admission_ends = time.monotonic()  # the grace over
        assert not idle.admitting()
        # a request asked just before the switch, or one is in flight: the whole grace for those on their way
        recent = watch()
        assert recent.admitting() and not recent.draining
        assert recent.notice(time.monotonic()) == GRACE_S and recent.admitting()
        inflight[0] = 1
        assert watch().notice(time.monotonic()) == GRACE_S
        # quiet for a whole grace before the switch: short again (a grace of 0 is no grace at all)
        inflight[0] = 0
        quiet = watch()
        assert quiet.admitting()
        assert quiet.notice(time.monotonic() + GRACE_S) == QUIET_GRACE_S
        none = watch(grace_s=0.0)
        assert none.admitting() and none.notice(time.monotonic()) == 0.0 and not none.admitting()
    finally:
        for w in watches:
            w.stop()
    assert drain_timeout(60) == 60 + GRACE_S + SHUTDOWN_MARGIN_S
    assert drain_timeout(60, grace_s=20) == 80 + SHUTDOWN_MARGIN_S  # a longer grace: a longer drain


def test_a_burst_of_health_probes_costs_one_lookup(monkeypatch):
    import asyncio

    import deployments.ingress.readiness as readiness

    calls = []

    def fake_status():
        calls.append("status")
        return status(1)

    monkeypatch.setattr(
        readiness,
        "serve",
        SimpleNamespace(status=fake_status, get_replica_context=lambda: SimpleNamespace(app_name="v")),
    )
    monkeypatch.setattr(readiness, "live_replica_count", lambda app, dep: 1)

    async def describe():
        return {"graphs_captured": True}

    async def burst():
        probe = readiness.Readiness(describe, total=1)
        return await asyncio.gather(*(probe() for _ in range(50)))

    answers = asyncio.run(burst())
    assert all(ready for ready, _ in answers) and calls == ["status"]


class _Switch:
    """The `DrainSwitch` actor's stand-in: `report.remote(id)` records, `drained.remote()` lists."""

    def __init__(self, drained=()):
        self.reports: list[str] = []
        self.report = SimpleNamespace(remote=self.reports.append)
        self.drained = SimpleNamespace(remote=lambda: list(drained))


class _Polls:
    """A stop event whose waits time out `n` times, then say stop: the watch loop runs `n` rounds, no clock."""

    def __init__(self, n: int):
        self.left = n

    def wait(self, timeout=None) -> bool:
        self.left -= 1
        return self.left < 0


def test_a_replica_reports_drained_only_once_its_grace_is_over(monkeypatch):
    """The stopping process shuts Serve down once every replica reported: a replica reporting while it still
    admits (in the grace after the switch) would have a request it admits then cut off by the shutdown."""
    import deployments.shutdown as shutdown

    switch = _Switch()
    monkeypatch.setattr(shutdown.ray, "get_actor", lambda name, namespace: switch)
    monkeypatch.setattr(shutdown.ray, "get", lambda ref, timeout=None: ref)
    watches = [DrainWatch(rid, lambda: 0, poll_s=60, grace_s=grace) for rid, grace in (("r1", 60), ("r2", 0.0))]
    parked = [w._stop for w in watches]  # their own threads park on these for a minute
    try:
        watch, over = watches
        assert watch.admitting()  # a request just now: the whole grace
        watch._stop = _Polls(5)
        watch._watch()  # sees the switch, then 4 rounds within the grace, nothing in flight
        assert watch.draining and watch.admitting() and switch.reports == []
        over._stop = _Polls(5)  # no grace: it reports at its first round
        over._watch()
        assert switch.reports == ["r2"]
    finally:
        for event in parked:
            event.set()


def test_drain_returns_once_every_ingress_replica_reported(monkeypatch):
    import deployments.shutdown as shutdown

    switch = _Switch(drained=["r1", "r2"])
    monkeypatch.setattr(
        shutdown, "DrainSwitch", SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=lambda: switch))
    )
    monkeypatch.setattr(shutdown, "_ingress_replicas", lambda: 2)
    monkeypatch.setattr(shutdown.ray, "get", lambda ref, timeout=None: ref)
    assert shutdown.drain(timeout_s=-1)  # all reported: drained, whatever the time left
    monkeypatch.setattr(shutdown, "_ingress_replicas", lambda: 3)
    assert not shutdown.drain(timeout_s=-1)


def test_a_draining_ingress_refuses_new_requests_counted_as_overloaded():
    """`POST /v1/embeddings` while the drain's grace is over: 503 `shutting_down` with Retry-After, before the body is
    read or anything admitted, and counted as `overloaded` (a refusal), not as a server error."""
    import asyncio

    import orjson
    from starlette.requests import Request

    from deployments.config import AppArgs
    from deployments.ingress.http_routes import HttpRoutes
    from deployments.ingress.limits import Admission
    from deployments.ingress.security import ApiKeyAuth
    from deployments.metrics import IngressTelemetry

    telemetry, done = IngressTelemetry(), []
    telemetry.request = lambda route, outcome, *counts: done.append((route, outcome))
    drain = SimpleNamespace(admitting=lambda: False, draining=True)
    admission = Admission(4)
    routes = HttpRoutes(
        AppArgs(), SimpleNamespace(info=None), None, admission, ApiKeyAuth(None), telemetry, None, drain
    )
    request = Request({"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": []})
    r = asyncio.run(routes.embeddings(request))
    assert r.status_code == 503 and orjson.loads(r.body)["error"]["code"] == "shutting_down"
    assert int(r.headers["retry-after"]) >= 1
    assert done == [("http", "overloaded")] and telemetry.counts["rejected"] == 1
    assert (admission.inflight, admission.bytes, admission.rejected) == (0, 0, 0)
