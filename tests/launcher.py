"""The launcher (`python -m deployments`) in a subprocess, as integration tests start it, and the raw-socket probe
of a huge request header that the HTTP-front tests share (fast and default request paths)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from deployments.ray_compat import FAST_PATH_ENV
from tests.serve_fixtures import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, str]:
    """A newcomer's environment: none of Serve's flags, no cluster address, no auth mode."""
    drop = {*FAST_PATH_ENV, "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "RAY_AUTH_MODE", "RAY_ADDRESS"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"PYTHONPATH": str(ROOT)}


@contextmanager
def running_launcher(
    log_dir: Path, args: list[str], env: dict[str, str] | None = None
) -> Iterator[tuple[int, subprocess.Popen, Path]]:
    """(port, process, log path) of `python -m deployments --port=PORT *args ingress_replicas=1` once its /health
    answers 200 (the test fails with the log's tail if it exits first). On leaving: SIGTERM and up to 90 s for its
    graceful stop, then SIGKILL to its whole process group."""
    port = free_port()
    log_path = log_dir / "launcher.log"
    log = log_path.open("w+")
    # `args`' options first: argparse takes KEY=VALUE positionals in one run, not split around an option
    cmd = [sys.executable, "-m", "deployments", f"--port={port}", *args, "ingress_replicas=1"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=environment() if env is None else env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited while starting:\n{log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, timeout_s=300, interval_s=0.5, what="the launcher's /health")
        yield port, proc, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def listener(port: int) -> str:
    """The name of the process listening on TCP `port` on this machine (`ss -ltnp`), "" when none is."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    names = re.findall(r'users:\(\("([^"]+)"', out)
    return names[0] if names else ""


def tiny_png() -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 90, np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def look_and_stop(port: int, proc: subprocess.Popen, log_path: Path) -> tuple[str, str]:
    """For a launcher started by `running_launcher`: wait for its ready line, send one embedding request, stop it
    with SIGTERM, and return (the name of the process listening on its port, its output). The request-path tests
    (issue 45.1) run this last in the modules whose launcher they share (tests/integration/serve/test_proxy_limits.py,
    test_default_path_limits.py): one launcher start each instead of one more of their own."""
    wait_for(lambda: "vision service ready" in log_path.read_text(), 60, what="the ready line")
    name = listener(port)
    r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": [tiny_png()]}, timeout=60)
    assert r.status_code == 200, r.text[:500]
    proc.send_signal(signal.SIGTERM)
    stopping = time.monotonic()
    proc.wait(timeout=90)
    print(f"stopped {time.monotonic() - stopping:.1f}s after SIGTERM")
    return name, log_path.read_text()


def status_line(sock: socket.socket) -> bytes:
    """The first line the server sends on `sock`, or b"" when it closes without one."""
    data = b""
    while b"\r\n" not in data:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def send_huge_header(port: int) -> tuple[bytes, float, int, list[float]]:
    """Send a 256 MiB header (as in issue 44) to `port` while another client polls /health, until the server stops
    taking bytes. Returns (the status line it answered, b"" if none; seconds until then; bytes sent; the /health
    latencies, at least one of them after the refusal)."""
    health_s: list[float] = []
    sending = threading.Event()
    sending.set()

    def poll_health():
        with httpx.Client(timeout=30) as client:
            while sending.is_set():
                t0 = time.monotonic()
                assert client.get(f"http://127.0.0.1:{port}/health").status_code == 200
                health_s.append(time.monotonic() - t0)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    wait_for(lambda: health_s, timeout_s=30, what="the first /health")
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    started = time.monotonic()
    sent = 0
    try:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Padding: ")
        chunk = b"a" * 2**20
        while sent < 256 * 2**20:  # 256 MiB of one header; the server stops reading early
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # refused and closed while we were still sending
        pass
    line = status_line(sock)
    elapsed = time.monotonic() - started
    sock.close()
    answered = len(health_s)
    wait_for(lambda: len(health_s) > answered, timeout_s=30, what="a /health after the refusal")
    sending.clear()
    poller.join(timeout=60)
    return line, elapsed, sent, health_s
