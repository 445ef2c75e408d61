"""Graceful shutdown: stop admitting, finish what was admitted, then let Serve shut down.

Why this exists: Serve's own shutdown (`serve.shutdown()`, which `serve run` calls on Ctrl-C, and the
`serve shutdown` CLI) kills the HTTP proxies at once (Ray 2.60 `ProxyState.shutdown`), so every request an
ingress replica is still working on loses its connection, and the ingress then waits out
`graceful_shutdown_timeout_s` for answers nobody can receive. So the service drains itself *before* Serve
is asked to shut down:

1. The stopping process creates the named actor `DrainSwitch` (`SWITCH_NAME` in namespace `NAMESPACE`);
   its existence is the signal. It is owned by that process, so it goes away with it.
2. Each ingress replica's `DrainWatch` looks the switch up every `POLL_S` (a thread: no event-loop work).
   Once it exists, `/health` answers 503 at once (load balancers stop sending), and `drain_grace_s`
   (`GRACE_S` by default) later admission ends: new requests get 503 `shutting_down` with `Retry-After`.
   The grace lets requests a client sent before the signal, still on their way through the proxy, be
   admitted rather than refused. A replica that was idle (nothing in flight, no request in the last grace)
   ends admission after `QUIET_GRACE_S` (or the grace, if shorter).
3. When the replica has nothing in flight it reports to the switch; the stopping process waits until every
   running ingress replica has reported, at most `drain_timeout(args)` (an admitted request ends within
   `request_timeout_s`, answered 504 at worst), then calls `serve.shutdown()`.

Where it runs: `serve run deployments:app` / `deployments:build_app ...` (`build_app` installs, in the
`serve run` process, a SIGINT handler and an exit hook that SIGTERM reaches; a second signal skips the
drain) and
`python -m deployments.shutdown` (drain, then `serve.shutdown()`: the graceful `serve shutdown`). A
`serve run config.yaml` process never imports this package, so its Ctrl-C is Serve's plain shutdown: run
`python -m deployments.shutdown --address ...` first.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import math
import signal
import sys
import threading
import time

import ray
from ray.serve.exceptions import BackPressureError

from deployments.ray_compat import (
    no_driver_stack_dump,
    quiet_serve_noise,
    quiet_serve_shutdown_notice,
    quiet_serve_system_info,
    quiet_token_auth_notice,
)

logger = logging.getLogger("ray.serve")

SWITCH_NAME = "vision-drain"
NAMESPACE = "vision"
POLL_S = 0.5  # how often an ingress looks for the switch: the delay before /health says 503
# Admission continues this long after the switch is seen, for requests already on their way: a request's
# handler can start seconds after Serve received it when the ingress's event loop is starved (measured
# 2.0 s on a loaded 2-CPU box, with a 64-image request decoding), and it must still be admitted then.
GRACE_S = 5.0
# A replica with nothing in flight and no request in the GRACE_S before it sees the switch (an idle service: Ctrl-C
# on a development box) ends admission after QUIET_GRACE_S instead: a request sent before the signal reaches an
# idle replica's handler within milliseconds. A starved event loop, what GRACE_S is for, has work in flight.
QUIET_GRACE_S = 1.0
# what the switch-and-report round trips and Serve's own teardown add to the longest admitted request
SHUTDOWN_MARGIN_S = 5.0


class ShuttingDownError(BackPressureError):
    """A handle call refused while the service drains (status 503, `retry_after_s`). The signature is
    `BackPressureError`'s, so it survives pickling to the caller."""

    def __init__(self, num_queued_requests=0, max_queued_requests=0, status_code=503, retry_after_s=None):
        super().__init__(num_queued_requests, max_queued_requests, status_code, retry_after_s)

    def __str__(self) -> str:
        return "the service is shutting down; retry after retry_after_s (another instance may serve)"


@ray.remote(num_cpus=0)
class DrainSwitch:
    """Exists while the service drains; counts the ingress replicas that have nothing left in flight."""

    def __init__(self):
        self._drained: set[str] = set()

    def report(self, replica_id: str) -> None:
        self._drained.add(replica_id)

    def drained(self) -> list[str]:
        return sorted(self._drained)


class DrainWatch:
    """One ingress replica's view of the drain (see the module docstring). `inflight()`: its admitted
    requests now. The watching thread is a daemon: it dies with the replica's process."""

    def __init__(self, replica_id: str, inflight, poll_s: float = POLL_S, grace_s: float = GRACE_S):
        self._replica_id, self._inflight, self._poll_s, self._grace_s = replica_id, inflight, poll_s, grace_s
        self._last_request = -math.inf  # when a request last asked to be admitted, before the switch
        self.admission_ends: float | None = None  # set when the switch is seen: the end of its grace
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="drain-watch", daemon=True).start()

    @property
    def draining(self) -> bool:
        """The service is shutting down (`/health` answers 503)."""
        return self.admission_ends is not None

    def admitting(self) -> bool:
        """New requests may still be admitted (not draining, or within the grace after the switch was seen). Each
        request asks once, as it arrives."""
        now = time.monotonic()
        if self.admission_ends is None:
            self._last_request = now
            return True
        return now < self.admission_ends

    def notice(self, now: float) -> float:
        """The switch is seen at `now`: the grace during which requests are still admitted (seconds)."""
        quiet = self._inflight() == 0 and now - self._last_request >= self._grace_s
        grace = min(self._grace_s, QUIET_GRACE_S) if quiet else self._grace_s
        self.admission_ends = now + grace
        return grace

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        switch = None
        while switch is None:
            if self._stop.wait(self._poll_s):
                return
            try:
                switch = ray.get_actor(SWITCH_NAME, namespace=NAMESPACE)
            except ValueError:  # no switch: not shutting down
                continue
            except Exception as e:  # noqa: BLE001 - the GCS unreachable now is no reason to stop watching
                logger.debug("drain switch lookup failed: %s", e)
                continue
        grace = self.notice(time.monotonic())
        logger.info("shutting down: /health answers 503, admission ends in %gs", grace)
        # after the grace nothing new is admitted, so the count only falls
        while not self._stop.wait(self._poll_s):
            if not self.admitting() and self._inflight() == 0:
                try:
                    ray.get(switch.report.remote(self._replica_id), timeout=10)
                    logger.info("drained: nothing in flight")
                    return
                except Exception as e:  # noqa: BLE001 - the stopping process went away: nothing to tell
                    logger.warning("could not report the drain: %s", e)
                    return


# ------------------------------------------------------------------------------------------ stopping side


def drain_timeout(request_timeout_s: float, grace_s: float = GRACE_S) -> float:
    """The longest a drain waits: admission ends `grace_s` (`drain_grace_s`) after the switch is seen, and an
    admitted request is answered within `request_timeout_s` (504 at worst)."""
    return request_timeout_s + grace_s + SHUTDOWN_MARGIN_S


def _ingress_replicas() -> int:
    """Running ingress replicas of every application on this Serve instance."""
    from ray import serve

    from deployments.config import INGRESS_NAME

    total = 0
    for app in serve.status().applications.values():
        dep = app.deployments.get(INGRESS_NAME)
        if dep is not None:
            total += dep.replica_states.get("RUNNING", 0)
    return total


def drain(timeout_s: float, poll_s: float = 0.2) -> bool:
    """Drain every ingress replica (see the module docstring); True when all reported within `timeout_s`.
    Needs a connected Ray (`ray.init`). The switch stays until this process ends (or `release()`)."""
    switch = DrainSwitch.options(name=SWITCH_NAME, namespace=NAMESPACE, get_if_exists=True).remote()
    deadline = time.monotonic() + timeout_s
    expected = _ingress_replicas()
    logger.warning("draining %d ingress replica(s), at most %.0fs", expected, timeout_s)
    while True:
        done = len(ray.get(switch.drained.remote()))
        if done >= expected:
            return True
        if time.monotonic() > deadline:
            logger.warning("drain timed out: %d of %d ingress replicas drained", done, expected)
            return False
        time.sleep(poll_s)  # polling remote counts; there is nothing local to wait on
        expected = _ingress_replicas()  # a replica that died meanwhile will never report


def release() -> None:
    """Remove the switch (ingress replicas started later admit again)."""
    try:
        ray.kill(ray.get_actor(SWITCH_NAME, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass


# ------------------------------------------------------------------------------------------ `serve run`


def in_serve_run() -> bool:
    """Whether this is the main thread of a `serve run` process (the Serve CLI is loaded)."""
    return "ray.serve.scripts" in sys.modules and threading.current_thread() is threading.main_thread()


def install_signal_drain(request_timeout_s: float, grace_s: float = GRACE_S) -> None:
    """Drain before `serve run` shuts Serve down, on SIGINT and on SIGTERM.

    SIGINT: our handler drains, then raises KeyboardInterrupt, on which `serve run` calls `serve.shutdown()`
    and exits. SIGTERM cannot be handled the same way: `ray.init` (which `serve run` calls after building
    the app) installs Ray's own SIGTERM handler, `sys.exit`, over any earlier one. So an exit hook drains
    and shuts Serve down when the process is leaving with Serve still up: atexit hooks run last-registered
    first, and Ray registers its shutdown hook when `ray` is imported, before this, so Ray is still
    connected here. After SIGINT's drain (Serve already shut down) the hook does nothing."""
    state = {"drained": False}

    def drain_once(why: str) -> None:
        state["drained"] = True
        logger.warning("%s: draining before Serve shuts down", why)
        try:
            drain(drain_timeout(request_timeout_s, grace_s))
        except Exception as e:  # noqa: BLE001 - a failed drain must not stop the shutdown itself
            logger.warning("drain failed (%s: %s); shutting down", type(e).__name__, e)

    def on_sigint(signum, frame):
        if state["drained"] or not ray.is_initialized():  # a second Ctrl-C, or nothing started: stop now
            raise KeyboardInterrupt
        drain_once("SIGINT")
        raise KeyboardInterrupt

    def on_exit() -> None:
        if state["drained"] or not ray.is_initialized():
            return
        from ray import serve

        # Were Ray's C++ failure-signal handler (absl) installed (`no_driver_stack_dump` keeps it out), it would
        # have seen the SIGTERM first and left an alarm of 3 s that kills the process mid-drain (measured)
        if hasattr(signal, "alarm"):
            signal.alarm(0)
        try:
            if _ingress_replicas() == 0:  # Serve already shut down (or never ran our app)
                return
        except Exception:  # noqa: BLE001 - no Serve to drain
            return
        drain_once("exiting (SIGTERM)")
        serve.shutdown()

    signal.signal(signal.SIGINT, on_sigint)
    atexit.register(on_exit)
    # before `serve run` connects to Ray: no stack dump and E-level lines on a plain SIGTERM, no notice that
    # token authentication is on (it stays on), none that Serve's controller "failed" when it shuts down, and
    # none of Serve's two uninformative INFO lines (`quiet_serve_noise`), and Serve's controller and proxy lines at
    # WARNING and above only, as the launcher has them (`quiet_serve_system_info`)
    no_driver_stack_dump()
    quiet_token_auth_notice()
    quiet_serve_shutdown_notice()
    quiet_serve_noise()
    quiet_serve_system_info()


def main(argv: list[str] | None = None) -> int:
    """`python -m deployments.shutdown [--address ADDR] [--timeout S] [--no-shutdown]`."""
    p = argparse.ArgumentParser(prog="python -m deployments.shutdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the running one)")
    p.add_argument(
        "--timeout", type=float, default=drain_timeout(60.0), help="longest drain, seconds (the default app's)"
    )
    p.add_argument("--no-shutdown", action="store_true", help="drain only; leave Serve running (refusing)")
    ns = p.parse_args(argv)
    from ray import serve

    quiet_serve_shutdown_notice()
    ray.init(address=ns.address, namespace="serve", logging_level=logging.WARNING)
    drained = drain(ns.timeout)
    if not ns.no_shutdown:
        serve.shutdown()
    print("drained" if drained else "drain timed out", "and shut down" if not ns.no_shutdown else "")
    return 0 if drained else 1


if __name__ == "__main__":
    sys.exit(main())
