"""Whether the application can serve: what the ingress's `GET /health` answers.

The encoder replicas are ready once Serve runs them (a replica runs only after its constructor returned,
and the constructor captures every bucket graph) and their `describe()` says so. The answer is cached for
a second: load balancers probe often and `serve.status()` is a controller round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ray import serve

from .config import ENCODER_NAME

CACHE_S = 1.0


def encoder_ready(status, app_name: str) -> tuple[bool, str]:
    """Whether `serve.status()` shows the app's encoder replicas running.

    A replica is RUNNING only after its constructor returned, and the constructor captures every
    bucket graph, so HEALTHY (running == target, health checks passing) means all graphs are captured.
    While the deployment is first deployed or updated (UPDATING) the answer is no. While the autoscaler
    adds or removes replicas (UPSCALING / DOWNSCALING) the running replicas keep serving with their graphs
    captured, and a replica joins the routing only once running, so the answer stays yes: a load balancer
    must not pull every ingress because the service is growing.
    """
    app = status.applications.get(app_name)
    dep = app.deployments.get(ENCODER_NAME) if app is not None else None
    if dep is None:
        return False, f"deployment {ENCODER_NAME} not found in application {app_name!r}"
    running = sum(n for state, n in dep.replica_states.items() if state == "RUNNING")
    state = getattr(dep.status, "value", dep.status)
    serving = state in ("HEALTHY", "UPSCALING", "DOWNSCALING")
    return serving and running > 0, f"{ENCODER_NAME}: {state}, {running} replica(s) running"


class Readiness:
    """`await readiness()` -> (ready, detail), from Serve's status and the encoder's `describe()`."""

    def __init__(self, describe: Callable[[], Awaitable[dict]]):
        self._describe = describe
        self._last: tuple[float, bool, str] = (-CACHE_S, False, "")

    async def __call__(self) -> tuple[bool, str]:
        checked, ready, detail = self._last
        if time.monotonic() - checked < CACHE_S:
            return ready, detail
        try:
            app_name = serve.get_replica_context().app_name
            ready, detail = encoder_ready(await asyncio.to_thread(serve.status), app_name)
            if ready:
                ready = bool((await asyncio.wait_for(self._describe(), timeout=5)).get("graphs_captured"))
        except Exception as e:  # noqa: BLE001 - not ready is the honest answer when status is unknown
            ready, detail = False, f"status unavailable: {type(e).__name__}: {e}"
        self._last = (time.monotonic(), ready, detail)
        return ready, detail
