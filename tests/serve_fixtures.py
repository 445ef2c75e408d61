"""Shared Ray / Serve fixtures for the service tests (tests/conftest.py registers `ray_cluster` for every module).

One Ray instance per test session (starting Ray costs ~8 s here), with logical resources so an
ingress and two encoder replicas fit on a 2-CPU machine, and one Serve instance (its controller and HTTP
proxy cost ~4 s to start): each module deploys what it needs with `running_app(...)` and deletes its
applications when it is done, so other modules can deploy after it. A module that shuts Serve (or Ray)
down itself is fine: the next `start_serve()` starts it again. Serve's HTTP proxy listens on a free port
(other test runs may share this machine).
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import ray
from ray import serve


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to `bind(0)` (Linux's `ip_local_port_range`; 32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free local TCP port below the kernel's ephemeral range. A port from `bind(0)` is one the kernel hands out
    again to the next `bind(0)`, and Ray's GCS, raylets, agents and workers bind that way: a `serve run` whose port
    was chosen so once failed "Failed to bind to address 127.0.0.1:42129", a Ray process of another case having
    taken it in the seconds before the service bound it. Below the range only an explicit bind takes a port."""
    low, rng = _ephemeral_low(), random.Random()
    for _ in range(200) if low > 20_001 else ():
        port = rng.randrange(20_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_ray() -> bool:
    """Start the session's Ray instance unless one is connected; whether this call started it. A module that
    needs a Ray of its own (`pytest.mark.own_ray`, run first: tests/conftest.py) shuts it down if it runs
    and leaves it down; whatever needs it after that starts it again here."""
    if ray.is_initialized():
        return False
    # log_to_driver=False: replica and worker logs stay in Ray's log files (/tmp/ray/session_*/logs) instead
    # of being printed into pytest's output by Ray's log monitor between tests
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    return True


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A Ray instance for the whole session (reused if something already started one)."""
    started = ensure_ray()
    yield
    if started and ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@dataclass
class Service:
    handle: serve.handle.DeploymentHandle | None
    base_url: str
    name: str


def start_serve() -> str:
    """Start Serve (HTTP on a free local port) if it is not running; the proxy's base URL."""
    from ray.serve.context import _get_global_client

    ensure_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port
    return f"http://127.0.0.1:{port}"


def delete_apps(names: list[str]) -> None:
    """Delete the named applications and wait until they are gone (Serve itself keeps running). If Serve
    is not running any more (the module shut it down), there is nothing to delete."""
    if not ray.is_initialized():
        return
    running = set(serve.status().applications)  # empty when no Serve instance runs
    from ray.serve.context import _get_global_client

    # all at once, then wait for them all (`serve.delete` is one app: deleted and waited for, then the next)
    _get_global_client().delete_apps([name for name in names if name in running], blocking=True)


@contextmanager
def running_app(app, name: str, route_prefix: str = "/") -> Iterator[Service]:
    """Deploy `app` (blocks until it is running); delete it afterwards."""
    base_url = start_serve()
    try:
        handle = serve.run(app, name=name, route_prefix=route_prefix)
        yield Service(handle, base_url, name)
    finally:
        delete_apps([name])


@contextmanager
def running_apps(apps: list[tuple[object, str, str]]) -> Iterator[list[Service]]:
    """Deploy several `(app, name, route_prefix)` side by side, concurrently (`serve.run_many`; each app's
    `base_url` ends in its prefix); delete them afterwards."""
    base_url = start_serve()
    try:
        handles = serve.run_many([serve.RunTarget(app, name=name, route_prefix=prefix) for app, name, prefix in apps])
        yield [
            Service(handle, base_url + prefix.rstrip("/"), name)
            for handle, (_, name, prefix) in zip(handles, apps, strict=True)
        ]
    finally:
        delete_apps([name for _, name, _ in apps])


def app_fixture(args: dict, name: str):
    """A module-scoped `app` fixture: `deployments.build_app(args)` running as `name` (`running_app`).
    Use as `app = app_fixture(ARGS, "name")` in a test module that lists this plugin."""

    @pytest.fixture(scope="module")
    def app(ray_cluster) -> Iterator[Service]:
        from deployments import build_app

        with running_app(build_app(args), name=name) as svc:
            yield svc

    return app


def wait_for(check: Callable[[], bool], timeout_s: float = 60.0, interval_s: float = 0.1, what: str = "") -> None:
    """Poll `check` until it returns True; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as e:  # noqa: BLE001 - keep polling; report the last error on timeout
            last = e
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what or check}: {last!r}")


def make_switch():
    """An actor a held replica waits on (`wait`), counting the waiters, until the test calls `release`."""

    @ray.remote(num_cpus=0)
    class Switch:  # defined here so Ray pickles it by value (tests/ is not importable on workers)
        def __init__(self):
            import asyncio

            self.event = asyncio.Event()
            self.waiting = 0

        async def wait(self):
            self.waiting += 1
            await self.event.wait()

        async def release(self):
            self.event.set()

        async def waiters(self) -> int:
            return self.waiting

    return Switch.remote()
