"""The runnable examples under examples/ against a running service.

The service is `deployments:app` imported the way `serve run deployments:app` imports it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import encoder

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
IMAGE = EXAMPLES / "images" / "gradient.jpg"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def service(ray_cluster):
    from ray.serve._private.utils import import_attr

    from tests.serve_fixtures import running_app

    with running_app(import_attr("deployments:app"), name="default") as svc:
        yield svc


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    return encoder.load("tiny").encode([IMAGE.read_bytes()], pooling="mean")[0].numpy()


def test_http_client_example(service, expected):
    out = load_example("http_client").main(service.base_url, IMAGE)
    np.testing.assert_allclose(np.array(out["mean"]["data"][0]["embedding"], np.float32), expected, atol=1e-4)
    shape = out["none"]["data"][0]["shape"]
    assert shape[1] == expected.shape[0] and len(out["none"]["data"][0]["embedding"]) == shape[0]


def test_openai_client_example(service, expected):
    vector, half = load_example("openai_client").main(service.base_url, IMAGE)
    np.testing.assert_allclose(np.array(vector, np.float32), expected, atol=1e-4)
    assert half.dtype == np.float16 and half.shape == expected.shape  # 64 values, had it been decoded as float32
    np.testing.assert_array_equal(half, np.asarray(vector, np.float32).astype(np.float16))


def test_handle_pipeline_example(service, expected):
    vectors = load_example("handle_pipeline").main(service.handle, IMAGE)
    assert len(vectors) == 3
    np.testing.assert_allclose(vectors[0], expected, atol=1e-4)  # the encoded bytes
    np.testing.assert_allclose(vectors[1], expected, atol=1e-4)  # the same image as PIL


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None, reason="needs curl and base64")
def test_curl_example(service, expected):
    done = subprocess.run(
        ["bash", str(EXAMPLES / "http_curl.sh"), service.base_url, str(IMAGE)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    body = json.loads(done.stdout)
    np.testing.assert_allclose(np.array(body["data"][0]["embedding"], np.float32), expected, atol=1e-4)


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
