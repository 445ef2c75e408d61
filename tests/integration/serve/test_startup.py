"""Start-up as a user meets it, in subprocesses: a bad model fails at once with one line and a non-zero exit
(`serve run`, the batch CLI). The launcher (`python -m deployments`) serving on the port it is given, refusing
a taken one and stopping cleanly on SIGTERM is checked in the same run as its drain: test_shutdown.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.slow
def test_the_launcher_reads_a_joined_clusters_request_path(ray_cluster):
    """`python -m deployments --address ...`: the ready line's request path is the cluster's (a task's environment
    on its nodes), not the launcher's."""
    from deployments.__main__ import cluster_environ
    from deployments.ray_compat import FAST_PATH_ENV

    assert cluster_environ() == {k: os.environ[k] for k in FAST_PATH_ENV if k in os.environ}
