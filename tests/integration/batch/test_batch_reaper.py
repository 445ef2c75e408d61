"""A SIGKILLed batch driver leaves no Ray processes behind (issue 17, item 8; `deployments.batch.reaper`).

The CLI runs as its own session on a local Ray it starts itself; once the job is running it is SIGKILLed.
Every process it started (GCS, raylet, agents, workers) carries its session id, so "nothing left" is: no
process of that session except the reaper, which ends once it has cleaned up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.images_util import encode, random_image
from tests.procs_util import session_processes
from tests.serve_fixtures import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_sigkilled_driver_leaves_no_ray_processes(tmp_path):
    src = tmp_path / "in.parquet"
    images = [encode(random_image("RGB", 64, 64, i), "PNG") for i in range(400)]
    pq.write_table(pa.table({"id": list(range(400)), "image": pa.array(images, pa.binary())}), src)
    err = tmp_path / "stderr.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT)}
    args = ["--input", str(src), "--output", str(tmp_path / "out"), "--part-rows", "20", "--no-progress"]
    with open(err, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.batch", *args],
            cwd=ROOT, env=env, stdout=fh, stderr=fh, start_new_session=True,
        )  # fmt: skip
    try:
        # the driver prints this once Ray is up and the job is planned
        wait_for(lambda: b"parts to do" in err.read_bytes() or proc.poll() is not None, timeout_s=300, interval_s=0.2)
        assert proc.poll() is None, err.read_text()[-3000:]
        assert any("raylet" in c for c in session_processes(proc.pid).values()), session_processes(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not session_processes(proc.pid), timeout_s=60, interval_s=0.5, what="the job's processes gone")
    finally:
        if session_processes(proc.pid):  # the test failed: do not leave them for the next run
            os.killpg(proc.pid, signal.SIGKILL)
