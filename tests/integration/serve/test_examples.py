"""The runnable examples under examples/ against a running service.

The service is `deployments:app` imported the way `serve run deployments:app` imports it.
"""

from __future__ import annotations

import importlib.util
import json
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
