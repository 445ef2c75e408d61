"""Whether the application can serve: what the ingress's `GET /health` answers.

200 iff at least one encoder replica can serve now; the body says how many of how many (`degraded` when some
are missing), so a load balancer keeps a working service and an operator still sees the loss.

An encoder replica can serve when Serve runs it (a replica runs only after its constructor returned, and the
constructor captures every bucket graph) and its actor is alive. Serve's status alone lags a death by its
health-check period (measured: 6.4 s of 200 after the only replica was killed) and marks the whole deployment
UNHEALTHY while a survivor serves (12.5 s of 503 with two replicas and one killed), so the count of running
replicas is capped by the live replica actors the GCS knows (`ray_compat.live_replica_count`), which drops as
soon as the actor's process is gone. The answer is cached for `CACHE_S`: load balancers probe often and both
lookups are round trips (a GCS and a controller call); with it the 503 follows the last replica's death
within ~1 s, under the issue's 2 s on a loaded 2-CPU box.

A replica whose actor lives but whose process makes no progress (frozen, hung: issue 44) passes both counts, so
the replicas this process's router judges stalled (`routing.progress`: a call or a liveness probe unanswered for
`replica_stall_timeout_s`) are taken off the serving count: `degraded` while another serves, 503 `stalled` when
none does, the message naming them and how long each has been silent. They count again once they answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ray import serve

from deployments.config import ENCODER_NAME
from deployments.ray_compat import live_replica_count
from deployments.routing.progress import progress_for

CACHE_S = 0.5


def encoder_ready(
    status, app_name: str, live: int | None = None, total: int | None = None, stalled: dict[str, float] | None = None
) -> tuple[bool, dict]:
    """(ready, detail) from `serve.status()` and the number of live encoder replica actors (`live`; None:
    unknown, trust Serve). Ready iff at least one replica is both running and alive, whatever the
    deployment's status (updating, autoscaling, unhealthy: the running replicas serve). `total`: the
    replicas the application's arguments ask for; Serve's count of them when it has more (an autoscaled
    deployment, or a config file's `num_replicas`, which the arguments do not see). `stalled`: replicas judged
    to make no progress (`routing.progress.ReplicaProgress.stalled_replicas`), not serving however alive."""
    app = status.applications.get(app_name)
    dep = app.deployments.get(ENCODER_NAME) if app is not None else None
    if dep is None:
        return False, {"status": "unavailable", "message": f"deployment {ENCODER_NAME} not found in {app_name!r}"}
    running = sum(n for state, n in dep.replica_states.items() if state == "RUNNING")
    stalled = stalled or {}
    serving = max(0, (running if live is None else min(running, live)) - len(stalled))
    total = max(total or 0, running, sum(dep.replica_states.values()))
    state = getattr(dep.status, "value", dep.status)
    if serving <= 0:
        word = "stalled" if stalled else "starting" if state == "UPDATING" and running == 0 else "unavailable"
    else:
        word = "ok" if serving >= total else "degraded"
    message = f"{ENCODER_NAME}: {state}, {running} running, {serving} serving of {total}"
    if stalled:
        silent = ", ".join(f"{rid} silent {s:g}s" for rid, s in sorted(stalled.items()))
        message += f"; {len(stalled)} stalled, making no progress ({silent})"
    replicas = {"serving": serving, "total": total} | ({"stalled": len(stalled)} if stalled else {})
    detail = {"status": word, "encoder_replicas": replicas, "message": message}
    return serving > 0, detail


class Readiness:
    """`await readiness()` -> (ready, detail dict), from Serve's status, the live replica actors and the
    encoder's `describe()`. `total`: the encoder replicas configured; `draining()`: the service is
    shutting down (then not ready, whatever the replicas)."""

    def __init__(
        self,
        describe: Callable[[], Awaitable[dict]],
        total: int | None = None,
        draining: Callable[[], bool] = lambda: False,
    ):
        self._describe, self._total, self._draining = describe, total, draining
        self._last: tuple[float, bool, dict] = (-CACHE_S, False, {})
        # one refresh at a time: a burst of probes (the route is open) costs one pair of lookups, not one each
        self._refreshing = asyncio.Lock()

    async def __call__(self) -> tuple[bool, dict]:
        if self._draining():
            return False, {"status": "draining", "message": "the service is shutting down"}
        checked, ready, detail = self._last
        if time.monotonic() - checked < CACHE_S:
            return ready, detail
        async with self._refreshing:
            checked, ready, detail = self._last
            if time.monotonic() - checked < CACHE_S:  # refreshed while this probe waited
                return ready, detail
            return await self._refresh()

    async def _refresh(self) -> tuple[bool, dict]:
        try:
            app_name = serve.get_replica_context().app_name
            status, live = await asyncio.gather(
                asyncio.to_thread(serve.status), asyncio.to_thread(live_replica_count, app_name, ENCODER_NAME)
            )
            progress = progress_for(app_name, create=False)  # made by the encoder client, with its stall timeout
            stalled = progress.stalled_replicas() if progress is not None else {}
            ready, detail = encoder_ready(status, app_name, live, self._total, stalled)
            if ready and not (await asyncio.wait_for(self._describe(), timeout=5)).get("graphs_captured"):
                ready, detail = False, detail | {"status": "starting"}
        except Exception as e:  # noqa: BLE001 - not ready is the honest answer when status is unknown
            ready, detail = False, {"status": "unavailable", "message": f"status unknown: {type(e).__name__}: {e}"}
        self._last = (time.monotonic(), ready, detail)
        return ready, detail
