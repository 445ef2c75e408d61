"""`python examples/handle_pipeline.py --local` as a user runs it: the example starts the tiny service on a Ray
instance of its own, in its own process. Marked `spawns_ray` (tests/conftest.py): it runs before the session's shared
Ray instance is up (~4 s less than beside it on the 2-core box). The examples against a running service:
`tests/integration/serve/test_examples.py`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


# a log line of Ray's (`2026-12-05 17:18:38,343\tINFO worker.py:2029 -- ...`) or Serve's (`INFO 2026-12-05 ...`)
RAY_INFO_LINE = re.compile(r"(^|\s)INFO\s")
# the service's own summary lines, one per replica (as the launcher prints them)
OWN_LINES = ("-- vision ingress: ", "-- encoder ready: ")


def test_handle_pipeline_local_is_quiet_and_opens_no_http_port():
    """Broken: `python examples/handle_pipeline.py --local` printed 18 Ray / Serve INFO lines and started Serve's
    HTTP proxy on port 8000, though it uses handles only. Here port 8000 is held by a plain listener, which a
    proxy (SO_REUSEPORT) cannot share: the example must not need it."""
    import os
    import socket
    import sys

    root = EXAMPLES.parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(root)}
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", 8000))
        except OSError:
            pytest.skip("port 8000 is in use on this machine")
        held.listen()
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "handle_pipeline.py"), "--local"],
            capture_output=True, text=True, timeout=180, env=env, cwd=root,
        )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "8 concurrent calls ->" in done.stdout, out
    noise = [line for line in out.splitlines() if RAY_INFO_LINE.search(line) and not any(o in line for o in OWN_LINES)]
    assert noise == [], out
    assert "Token authentication" not in out and "killed by `ray.kill`" not in out, out
