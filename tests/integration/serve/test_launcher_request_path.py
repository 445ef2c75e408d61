"""The launcher's request path (issue 45.1): `python -m deployments` started with none of Serve's flags exported
runs Serve's fast path (throughput mode, HAProxy in front of the ingress replicas, handle calls over gRPC), and
`--request-path default` Serve's default one (Python HTTP proxy, actor calls). Observables: who listens on the
port (`ss -ltnp`: the `haproxy` process, or Serve's Python `ProxyActor`), the ingress replicas' start-up line
(what Serve read in their environment) and the launcher's ready line, which name the path.

Each case starts its own Ray in a launcher subprocess (~15-40 s on the 2-core box); SIGTERM ends it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.launcher import running_launcher
from tests.serve_fixtures import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]


def listener(port: int) -> str:
    """The name of the process listening on TCP `port` on this machine (`ss -ltnp`), "" when none is."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    names = re.findall(r'users:\(\("([^"]+)"', out)
    return names[0] if names else ""


def launch_and_look(tmp_path: Path, args: list[str]) -> tuple[str, str]:
    """Start the launcher with `args`, wait for /health 200, and return (the listener's name, the output so far);
    the launcher is stopped with SIGTERM (its whole process group if it does not exit)."""
    with running_launcher(tmp_path, args) as (port, proc, log_path):
        wait_for(lambda: "vision service ready" in log_path.read_text(), 60, what="the ready line")
        name = listener(port)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": [tiny_png()]}, timeout=60)
        assert r.status_code == 200, r.text[:500]
        proc.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        proc.wait(timeout=90)
        print(f"{args}: stopped {time.monotonic() - stopping:.1f}s after SIGTERM")
    return name, log_path.read_text()


def tiny_png() -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 90, np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_the_launcher_runs_the_fast_path_with_nothing_exported(tmp_path):
    name, output = launch_and_look(tmp_path, [])
    assert name == "haproxy", (name, output[-3000:])  # HAProxy answers on the port, not Serve's Python proxy
    lines = output.splitlines()
    # the application line (the environment Ray inherited), the ingress replica's (what Serve read in it: its handle
    # to the encoders sends over gRPC) and the ready line name the path
    for what in ("vision app:", "vision ingress:", "vision service ready"):
        named = [line for line in lines if what in line]
        assert len(named) == 1 and "request path fast (HAProxy, gRPC)" in named[0], (what, output[-3000:])
    assert any("encoder ready:" in line for line in lines), output[-3000:]  # the replicas' lines reach the console
    # Serve's controller at WARNING: not its multi-line "Throughput optimized Ray Serve enabled" INFO record
    assert "ServeController" not in output and "Throughput optimized" not in output, output[-3000:]
    assert "Traceback" not in output and "failed to shut down" not in output, output[-3000:]
    # nor an ingress replica's lines about its HTTP port (`quiet_serve_noise`)
    assert "Allocated port" not in output and "Started HTTP server on port" not in output, output[-3000:]


def test_request_path_default_keeps_serves_own_proxy(tmp_path):
    name, output = launch_and_look(tmp_path, ["--request-path", "default"])
    assert name != "haproxy" and "ProxyActor" in name, (name, output[-3000:])
    ready = [line for line in output.splitlines() if "vision service ready" in line]
    assert len(ready) == 1 and "request path default (Serve's Python proxy, actor calls)" in ready[0], output
    assert "drop --request-path default for the fast one" in ready[0], ready
    assert any("vision app:" in line and "request path default" in line for line in output.splitlines()), output
    assert "Traceback" not in output, output[-3000:]
