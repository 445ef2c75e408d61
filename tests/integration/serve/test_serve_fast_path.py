"""The app under Ray Serve's fast request path (README "Fast path"): throughput-optimised Serve (handle
calls over gRPC, user code on the replicas' loops) with HAProxy in front of the ingress replicas.

The flags are read when Ray's processes start, so the app runs on a Ray instance of its own in a child
process (`fast_path_app.py`), with the launcher's flags (`ray_compat.FAST_PATH_ENV`) and nothing else of
Serve's: the driver calls its handles synchronously (`.result()`), which in throughput mode works because
`build_app` gives a driver's handles a router loop of their own (`ray_compat.sync_driver_handles`; without
it the first `.result()` raises "No event loop running"); one `embed` call carries 32 224x224 arrays
(4.8 MB, over gRPC's default 4 MiB message cap, hence the raised cap). An encoder replica killed
with a batch inside loses no HTTP request (the ingress retries it on the other replica).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.ray_compat import FAST_PATH_ENV

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]

# the launcher's flags; a replica being stopped drains for 1 s, not Serve's default
TEST_ENV = FAST_PATH_ENV | {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def test_app_serves_handles_and_http_through_haproxy_and_grpc():
    drop = {"RAY_ADDRESS", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"}
    env = {k: v for k, v in os.environ.items() if k not in drop} | TEST_ENV
    script = Path(__file__).with_name("fast_path_app.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["handle_count"] == 32
    assert result["handle_max_abs_diff"] < 1e-4  # equal to VisionEncoder.encode on the same images
    assert result["http_status"] == 200 and result["http_max_abs_diff"] < 1e-4
    assert (result["bad_status"], result["bad_code"]) == (400, "invalid_base64")
    # an encoder replica killed with a batch inside: nothing lost, the ingress retried elsewhere
    assert result["kill_requests"] >= 64 and result["kill_failures"] == 0, result
    assert result["kill_retries"] >= 1, result
