"""Start-up as a user meets it, in subprocesses: a bad model fails at once with one line and a non-zero exit
(`serve run`, the batch CLI), the launcher (`python -m deployments`) serves on the port it is given, refuses a
taken one, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
# Broken, `serve run ... model=/nonexistent/dir` exited 0 after 42 s (three replica tracebacks); working it
# takes the CLI's imports, ~6 s here. The bound separates the two with room for a loaded machine.
FAILS_WITHIN_S = 30


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": str(ROOT)}
    out.pop("RAY_ADDRESS", None)  # their own local Ray, never a cluster of this machine
    return out


def run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


def test_serve_run_with_a_bad_model_fails_at_once_in_one_line():
    done, seconds = run([str(BIN / "serve"), "run", "deployments:build_app", "model=/nonexistent/dir"])
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert seconds < FAILS_WITHIN_S, f"{seconds:.0f}s"
    assert output.count("'/nonexistent/dir': no such directory") == 1, output  # once, not per replica restart
    assert "expected a preset (tiny" in output and "Traceback" not in output, output


@pytest.mark.slow  # the same in-process: tests/unit/deployments/batch/test_job_driver.py
def test_batch_cli_with_a_bad_model_exits_2_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "deployments.batch", "--input", str(tmp_path), "--output", str(tmp_path / "out")]
    done, seconds = run([*cmd, "--model", "/nonexistent/dir"])
    assert done.returncode == 2, done.stderr
    assert seconds < FAILS_WITHIN_S
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'/nonexistent/dir': no such directory" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


class Process:
    """A subprocess whose merged output is read by a thread, so waiting for a line has a deadline."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout_s}s:\n{''.join(self.seen[-40:])}")

    def rest(self, timeout_s: float) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout_s)
        while (line := self.lines.get(timeout=timeout_s)) is not None:
            self.seen.append(line)
        return code, "".join(self.seen)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_launcher_serves_on_its_port_refuses_a_taken_one_and_stops_cleanly():
    port = free_port()
    service = Process([sys.executable, "-m", "deployments", f"--port={port}"])
    try:
        service.wait_for(f"ready at http://127.0.0.1:{port}/v1", timeout_s=240)
        (model,) = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
        assert model["id"] == "tiny" and model["random_weights"] is True
        # a second service on the same port: refused before Ray starts, instead of splitting the requests
        done, seconds = run([sys.executable, "-m", "deployments", f"--port={port}"])
        assert done.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in done.stderr, done.stderr
        assert "Started a local Ray instance" not in done.stderr and seconds < FAILS_WITHIN_S
        service.proc.send_signal(signal.SIGTERM)
        code, output = service.rest(timeout_s=120)
    finally:
        if service.proc.poll() is None:
            service.proc.kill()
    assert code == 0, output
    assert "Traceback" not in output and "SIGTERM received" not in output, output
