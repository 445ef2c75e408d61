"""The committed Serve config (`deployments/serve_config.yaml`) deploys and answers over HTTP.

Deployed the way `serve run deployments/serve_config.yaml` does it (schema validation, then the
controller builds `deployments:build_app` from the YAML's args), on the session's Ray instance.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest
import yaml

from tests.images_util import encode, random_image

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[3] / "deployments" / "serve_config.yaml"


def test_committed_serve_config_deploys(ray_cluster):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import AppArgs
    from tests.serve_fixtures import delete_apps, start_serve, wait_for

    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    AppArgs.model_validate(app.args)  # the args are valid before anything is deployed
    base_url = start_serve()  # on a free port: the YAML's 8000 may be taken on a shared machine
    try:
        _get_global_client().deploy_apps(config, _blocking=False)

        def healthy() -> bool:  # 200 once one replica serves; "ok" once all of them do (not "degraded")
            r = httpx.get(f"{base_url}/health", timeout=10)
            return r.status_code == 200 and r.json()["status"] == "ok"

        wait_for(healthy, timeout_s=120, what="the YAML application's /health")
        # the controller marks the application RUNNING on its next pass
        wait_for(lambda: serve.status().applications[app.name].status == "RUNNING", timeout_s=30)
        status = serve.status().applications[app.name]
        assert status.deployments["VisionEncoder"].replica_states.get("RUNNING") == app.args["num_replicas"]
        url = "data:image/png;base64," + base64.b64encode(encode(random_image("RGB", 64, 64), "PNG")).decode()
        r = httpx.post(f"{base_url}/v1/embeddings", json={"input": [url], "model": app.args["model"]}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["embedding"]) == 128
    finally:  # Serve keeps running for the next module (restarting it costs its controller and proxy again)
        delete_apps([app.name])
