"""`deployments.batch.reaper`: what a SIGKILLed driver started is ended, including processes started after the
watcher's last look (no Ray here: plain processes stand in for the raylet and its workers; the watcher polls
every 60 s, so only its first note, its last look and its looks while they go down can find them).

1. The stand-in raylet ignores SIGTERM, as a process slow to go down would, and starts a worker twice: once
   when told to, after the watcher's first note, and once while it is being terminated.
2. The stand-in raylet starts a worker (its command line is a Ray worker's) and exits before the driver is
   killed, as Ray's raylet dies with its driver: the worker is an orphan that no walk from the driver reaches.

Working, every process of the driver's session is gone about a second (the grace) after the kill; broken (a
watcher that walks only from the driver, does not look again while they go down, or misses orphaned workers),
a worker lives on for the 600 s it sleeps, and the wait below fails after 30 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs_util import session_processes
from tests.serve_fixtures import wait_for

ROOT = Path(__file__).resolve().parents[4]

# argv: the file the workers' pids are written to, the worker's script; stdin: "go" starts the worker
RAYLET = r"""
import signal, subprocess, sys
def worker(name):
    w = subprocess.Popen([sys.executable, sys.argv[2]])
    with open(sys.argv[1], "a") as fh:
        fh.write(f"{name} {w.pid}\n")
if sys.argv[3] == "slow-to-go":
    signal.signal(signal.SIGTERM, lambda *_: worker("while-terminated"))
print("ready", flush=True)
sys.stdin.readline()
worker("after-the-note")
print("started", flush=True)
if sys.argv[3] == "slow-to-go":
    while True:
        signal.pause()
"""

DRIVER = r"""
import subprocess, sys
from deployments.batch.reaper import start_reaper
raylet = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
assert raylet.stdout.readline() == "ready\n"
assert start_reaper(poll_s=60.0, grace_s=1.0)
raylet.stdin.write("go\n")
raylet.stdin.flush()
assert raylet.stdout.readline() == "started\n"
if sys.argv[4] == "dies-first":
    raylet.wait()
print("started", flush=True)
sys.stdin.readline()  # until it is killed
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize(
    "raylet, late_workers, running",
    [
        ("slow-to-go", {"after-the-note", "while-terminated"}, 3),  # the driver, its raylet, one worker
        ("dies-first", {"after-the-note"}, 2),  # the driver and the orphaned worker
    ],
    ids=["raylet slow to go", "raylet gone first"],
)
def test_processes_started_after_the_last_poll_are_ended_with_the_killed_driver(
    tmp_path, raylet, late_workers, running
):
    pids = tmp_path / "workers.txt"
    # named as Ray's workers are: the watcher takes an orphaned process only if it is one
    script = tmp_path / "ray" / "_private" / "workers" / "default_worker.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time\ntime.sleep(600)\n")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, RAYLET, str(pids), str(script), raylet],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        assert driver.stdout.readline() == "started\n"
        assert len(session_processes(driver.pid)) == running  # the watcher runs in a session of its own
        driver.kill()
        driver.wait()
        wait_for(lambda: not session_processes(driver.pid), timeout_s=30, what="the driver's processes gone")
        started = dict(line.split() for line in pids.read_text().splitlines())
        assert started.keys() == late_workers  # each kind of late worker was there
    finally:
        for pid in session_processes(driver.pid):  # the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)
