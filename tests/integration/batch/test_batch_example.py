"""`python examples/batch_job.py` as a user runs it: the example embeds a Parquet file on a Ray instance of its own,
in its own process. Marked `spawns_ray` (tests/conftest.py): it runs before the session's shared Ray instance is up
(~5 s less than beside it on the 2-core box). The example called in-process, on the shared instance:
`tests/integration/batch/test_batch.py::test_example_runs`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]

ROOT = Path(__file__).resolve().parents[3]


# a log line of Ray's (`2026-12-05 17:18:38,343\tINFO worker.py:2029 -- ...`) or Serve's (`INFO 2026-12-05 ...`)
RAY_INFO_LINE = re.compile(r"(^|\s)INFO\s")


def test_example_prints_no_ray_info_lines_nor_the_token_notice():
    """Broken: `python examples/batch_job.py` printed ~46 lines: Ray's token-authentication notice, its
    "Started a local Ray instance" line, and Ray Data's execution plans and progress at INFO."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "batch_job.py"), "--num-images", "8"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "8 rows, embedding dim 128, 0 error rows" in done.stdout
    assert [line for line in out.splitlines() if RAY_INFO_LINE.search(line)] == [], out
    assert "Token authentication" not in out and "killed by `ray.kill`" not in out, out
    assert len(out.splitlines()) <= 10, out
