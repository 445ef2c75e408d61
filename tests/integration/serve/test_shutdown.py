"""Graceful shutdown of `serve run` and of the launcher `python -m deployments` (issue 17, item 5).

`serve run deployments:build_app model=tiny` (or the launcher) runs as a subprocess on a free port with its
own Ray. Eight client loops send one-image requests and one long request (many images) is in flight when the
process gets SIGINT (as Ctrl-C sends it, to the process group) or SIGTERM: every request sent before the signal
is answered 200, requests after it get 200 (still on their way) or 503 `shutting_down` with Retry-After or a
refused connection, and the process is gone within 60 s (issue 17's bound is 40 s; it takes 10.5-11.8 s). The
launcher's run also checks what a user meets first: it serves on the port it is given (the start-up summary
names the URL, `/v1/models` marks the random weights), a second launcher on the same port is refused at once,
and SIGTERM ends it with status 0 and no traceback.

Each case's process starts when the case before it has sent its signal (`Launches`): its start-up overlaps the
other's drain.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from deployments.ray_compat import SERVE_SHUTDOWN_NOTICE, TOKEN_AUTH_NOTICE
from encoder.errors import RandomWeightsWarning
from tests.serve_fixtures import free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]

ROOT = Path(__file__).resolve().parents[3]
# Working, the process is gone 10.5-11.8 s after the signal (2026-12-02); issue 17's bound is 40 s, but a bound in a
# test stays 5x above what it measures (issue 18). Broken (no drain, or a drain that never ends) is
# request_timeout_s + 45 s = 75 s here, or never
DOWN_WITHIN_S = 60.0
# Broken (before issue 18), a second service on a taken port started its own Ray and split the requests;
# working, the refusal takes the launcher's imports, ~6 s here. The bound separates the two with room.
REFUSED_WITHIN_S = 30.0


def png_url(side: int, seed: int) -> str:
    # a smooth picture: small as PNG, so the long request is long to encode, not to send
    y, x = np.mgrid[0:side, 0:side]
    pixels = np.stack([(x + seed) % 256, (y * 2) % 256, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def command(kind: str, port: int, args: list[str]) -> list[str]:
    if kind == "launcher":
        return [sys.executable, "-m", "deployments", f"--port={port}", *args]
    return [sys.executable, "-m", "tests.serve_run_port", str(port), "deployments:build_app", *args]


def environment() -> dict[str, str]:
    # its own Ray, never a cluster here; RAY_AUTH_MODE unset, as a newcomer has it (a Ray instance started earlier
    # in this session sets it for this process): Ray then turns token authentication on and announces it
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    return env | {"PYTHONPATH": str(ROOT), "RAY_ADDRESS": "local"}


@dataclass
class Launch:
    kind: str  # "serve run" or "launcher"
    how: str  # a key of SIGNALS
    proc: subprocess.Popen
    port: int
    log: Path


class Launches:
    """The selected cases' processes. Each is started while the case before it drains and exits, so its start-up
    (~15 s of imports, Ray, Serve and the deployment) overlaps that wait instead of following it. They are
    independent: each has its own port, log and Ray instance, and its own process group."""

    def __init__(self, cases: list[tuple[str, str]], log_dir: Path):
        self.cases, self.log_dir = cases, log_dir
        self.started: dict[tuple[str, str], Launch] = {}
        self.logs: list = []

    def take(self, case: tuple[str, str]) -> Launch:
        if case not in self.started:
            port = free_port()
            log_path = self.log_dir / f"case{len(self.started)}.log"
            log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
            self.logs.append(log)
            args = ["model=tiny", "ingress_batch_size=0", "request_timeout_s=30"]
            proc = subprocess.Popen(
                command(case[0], port, args),
                cwd=ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            self.started[case] = Launch(*case, proc, port, log_path)
        return self.started[case]

    def start_the_next(self, case: tuple[str, str]) -> None:
        at = self.cases.index(case)
        if at + 1 < len(self.cases):
            self.take(self.cases[at + 1])

    def kill(self, launch: Launch) -> None:
        if launch.proc.poll() is None:  # a test failed: take the whole session (its Ray included) down
            os.killpg(launch.proc.pid, signal.SIGKILL)
            launch.proc.wait()

    def close(self) -> None:
        for launch in self.started.values():
            self.kill(launch)
        for log in self.logs:
            log.close()


CASES = [("serve run", "SIGINT to the group (Ctrl-C)"), ("serve run", "SIGTERM to the process"),
         ("launcher", "SIGTERM to the process")]  # fmt: skip


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> Iterator[Launches]:
    # the cases this session runs, in their order (`-k` may select some)
    selected = [
        tuple(item.callspec.params["launch"])
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "launch" in item.callspec.params
    ]
    launched = Launches(selected, tmp_path_factory.mktemp("shutdown"))
    try:
        yield launched
    finally:
        launched.close()


@pytest.fixture
def launch(request, launches) -> Iterator[Launch]:
    started = launches.take(tuple(request.param))
    try:
        yield started
    finally:
        launches.kill(started)


# SIGINT to the whole process group is what Ctrl-C in a terminal does (Ray's own processes block SIGINT);
# SIGTERM to the process is what `kill PID` or a process manager does.
SIGNALS = {
    "SIGINT to the group (Ctrl-C)": (os.killpg, signal.SIGINT),
    "SIGTERM to the process": (os.kill, signal.SIGTERM),
}


def check_the_port_is_refused_to_a_second_launcher(port: int) -> None:
    started = time.monotonic()
    cmd = command("launcher", port, [])
    done = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    assert done.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in done.stderr, done.stderr
    assert "Started a local Ray instance" not in done.stderr and seconds < REFUSED_WITHIN_S, (seconds, done.stderr)


@pytest.mark.parametrize("launch", CASES, indirect=True, ids=[f"{kind}-{how}" for kind, how in CASES])
def test_a_signal_answers_everything_admitted_and_exits(launch, launches):
    proc, port, log, how = launch.proc, launch.port, launch.log, launch.how
    base = f"http://127.0.0.1:{port}"
    launcher = launch.kind == "launcher"
    send, signum = SIGNALS[how]

    def healthy() -> bool:
        if proc.poll() is not None:  # pytest.fail is not an Exception: wait_for does not swallow it
            pytest.fail(f"{launch.kind} exited while starting:\n{log.read_text()[-3000:]}")
        return httpx.get(f"{base}/health", timeout=5).status_code == 200

    wait_for(healthy, timeout_s=300, interval_s=0.5, what="serve run's /health")
    if launcher:
        (model,) = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        assert model["id"] == "tiny" and model["random_weights"] is True, model
        check_the_port_is_refused_to_a_second_launcher(port)
    small = {"input": [png_url(64, 1)]}
    # 12 images of 448² (784 patches each): two encoder batches on a CPU, seconds of work still running at the
    # signal (asserted below) without making every case wait out a longer drain
    long_body = {"input": [png_url(448, i) for i in range(12)]}
    results: list[tuple[str, float, object]] = []  # (who, sent at, status or exception)
    lock = threading.Lock()
    signalled = threading.Event()
    ok_counts = [0] * 8
    sending: list[tuple[str, float]] = []  # (who, sent at), appended as each request goes out

    def loop(k: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as client:
            while True:
                sent = time.monotonic()
                with lock:
                    sending.append((f"loop{k}", sent))
                try:
                    r = client.post("/v1/embeddings", json=small)
                    outcome = (r.status_code, r.headers.get("retry-after"), r.json().get("error", {}).get("code"))
                except Exception as e:  # noqa: BLE001 - a refused connection after the signal is expected
                    outcome = e
                with lock:
                    results.append((f"loop{k}", sent, outcome))
                if isinstance(outcome, tuple) and outcome[0] == 200:
                    ok_counts[k] += 1
                    continue
                return  # a failure before the signal is reported by the assertions below

    def long_request() -> None:
        sent = time.monotonic()
        with lock:
            sending.append(("long", sent))
        try:
            r = httpx.post(f"{base}/v1/embeddings", json=long_body, timeout=120)
            outcome = (r.status_code, None, r.text[:300] if r.status_code != 200 else None)
        except Exception as e:  # noqa: BLE001
            outcome = e
        with lock:
            results.append(("long", sent, outcome))

    loops = [threading.Thread(target=loop, args=(k,)) for k in range(8)]
    for t in loops:
        t.start()
    wait_for(lambda: min(ok_counts) >= 2, timeout_s=120, what="every client loop answered twice (warm)")
    long_thread = threading.Thread(target=long_request)
    long_thread.start()
    # every loop has a request out that was sent after the long one: nine requests in flight at the signal
    wait_for(lambda: any(who == "long" for who, *_ in sending), timeout_s=30, what="the long request sent")
    long_sent = next(at for who, at in sending if who == "long")
    wait_for(
        lambda: all(any(who == f"loop{k}" and at > long_sent for who, at in sending) for k in range(8)),
        timeout_s=60,
        what="every loop sending after the long request",
    )
    assert long_thread.is_alive(), f"the long request ended before the signal: {[r for r in results if r[0] == 'long']}"
    signal_at = time.monotonic()
    signalled.set()
    send(proc.pid, signum)
    launches.start_the_next((launch.kind, how))  # while this one drains and exits
    try:
        proc.wait(timeout=DOWN_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{launch.kind} still up {DOWN_WITHIN_S}s after {how}:\n{log.read_text()[-4000:]}")
    down_after = time.monotonic() - signal_at
    long_thread.join(timeout=30)
    for t in loops:
        t.join(timeout=30)
    before = [(who, outcome) for who, sent, outcome in results if sent < signal_at]
    after = [(who, outcome) for who, sent, outcome in results if sent >= signal_at]
    assert any(who == "long" for who, _ in before)
    bad = [(who, o) for who, o in before if not (isinstance(o, tuple) and o[0] == 200)]
    assert not bad, f"requests sent before the signal not answered 200: {bad}\n{log.read_text()[-3000:]}"
    for who, o in after:  # after the signal: admitted in the grace, refused with Retry-After, or no listener
        if isinstance(o, tuple) and o[0] != 200:
            assert o[0] == 503 and o[1] is not None, (who, o)
    output = log.read_text()
    # no traceback from any process of the service (a decode worker whose ingress replica is stopped used to
    # print one when its pipe was reset, not on every run:
    # tests/unit/deployments/ingress/test_decode_pool.py pins it down)
    assert "Traceback" not in output, output[-3000:]
    # nor a stack dump (Ray's failure-signal handler printed one, twice, on SIGTERM to `serve run`)
    assert "SIGTERM received" not in output, output[-3000:]
    assert TOKEN_AUTH_NOTICE not in output, output[-3000:]  # authentication is on; the notice is dropped
    assert SERVE_SHUTDOWN_NOTICE not in output, output[-3000:]  # Serve's controller ending itself is no failure
    # no object repr: each ingress replica's router logged `Started <...SharedRouterLongPollClient object at 0x...>`,
    # and so did Serve's proxy
    reprs = [line for line in output.splitlines() if "object at 0x" in line]
    assert not reprs, reprs
    # Serve's controller and proxies at WARNING (the launcher sets their level, `serve run`'s driver drops their INFO
    # lines): none of their lines for each deployment step
    assert "Adding 1 replica to Deployment" not in output and "Got updated endpoints" not in output, output[-3000:]
    assert "ServeController" not in output and "ProxyActor" not in output, output[-3000:]
    # a preset's random weights: said once by the driver, in one line; the replica's ready line marks them, and it
    # no longer repeats the warning in warnings' file:line form
    assert output.count(RandomWeightsWarning.message("tiny")) == 1, output[-3000:]
    assert "RandomWeightsWarning" not in output and "encoder ready: tiny, RANDOM weights" in output, output[-3000:]
    if launcher:
        assert proc.returncode == 0, output[-3000:]
        assert f"ready at http://127.0.0.1:{port}/v1" in output, output[-3000:]
        # nor serve.run's notice that the http_options "will not be applied" (the launcher's serve.start applied them)
        assert "will not be applied" not in output, output[-3000:]
    print(f"down {down_after:.1f}s after {how}; {len(before)} requests before it, {len(after)} after")
