"""`python -m deployments --config deployments/serve_config.yaml` serves the committed Serve config, quietly: where
`serve run deployments/serve_config.yaml` prints Serve's CLI lines, Ray's token notice, the controller's and proxies'
INFO lines and, at the stop, the "killed by `ray.kill`" line, the launcher prints the application's own lines.

One launcher subprocess with a Ray of its own (~30-60 s on the 2-core box); SIGTERM ends it. The mapping of the file
and each refusal: tests/unit/deployments/test_launch_config.py.
"""

from __future__ import annotations

import signal

import pytest

from tests.launcher import running_launcher
from tests.serve_fixtures import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]

# what `serve run deployments/serve_config.yaml` prints around the application's lines (Ray 2.60)
SERVE_RUN_NOISE = (
    "scripts.py",  # Serve's CLI: "Running config file", "Submitted deploy config successfully", "Got KeyboardInterrupt"
    "Token authentication is enabled",
    "(ServeController",  # "Deploying new app", "Adding 2 replicas to Deployment(...)", "Replica(...) is stopped"
    "(ProxyActor",  # "Proxy starting on node", "Got updated endpoints"
    "(build_serve_application",
    "killed by `ray.kill`",
)


def test_the_launcher_runs_the_small_serve_config_quietly(tmp_path):
    # running_launcher adds --port=<a free one> (over the file's 8000) and ingress_replicas=1 (the file's value);
    # num_replicas=1 over the file's 2, to check the file's other args still apply
    args = ["--config", "deployments/serve_config.yaml", "model=tiny", "num_replicas=1"]
    with running_launcher(tmp_path, args) as (port, proc, log_path):  # returns once /health answers 200
        wait_for(lambda: "vision service ready" in log_path.read_text(), 60, what="the ready line")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    output = log_path.read_text()
    assert proc.returncode == 0, output[-3000:]
    lines = output.splitlines()
    # the file's args with the pair over them: one encoder replica, the file's num_cpus 0.25
    (app_line,) = [line for line in lines if "vision app:" in line]
    assert "model=tiny" in app_line and "1 encoder replica(s) x 0 GPU / 0.25 CPU" in app_line, app_line
    ready = [line for line in lines if "vision service ready" in line]
    assert len(ready) == 1 and f"ready at http://127.0.0.1:{port}/v1" in ready[0], output[-3000:]
    noise = [line for line in lines if any(mark in line for mark in SERVE_RUN_NOISE)]
    assert not noise, "\n".join(noise)
    # none of the controller's INFO lines for each deployment step, wherever they come from
    steps = ("Deploying new", "Adding 1 replica", "Got updated endpoints", "is stopped", "Removing 1 replica")
    assert not [line for line in lines if any(step in line for step in steps)], output[-3000:]
    assert "Traceback" not in output and not [line for line in lines if line.startswith("error:")], output[-3000:]
