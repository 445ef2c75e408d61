"""CLIP through the Serve app on CPU Ray: the model's own embedding by default, over HTTP and handles."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

import encoder
from tests.images_util import encode, random_image
from tests.serve_fixtures import app_fixture

pytestmark = pytest.mark.slow


app = app_fixture({"model": "tiny-clip", "num_replicas": 1}, "clip")


def test_clip_http_and_handle_match_encoder(app):
    ref = encoder.load("tiny-clip")
    images = [encode(random_image("RGB", 50 + 30 * i, 90, seed=i), "PNG") for i in range(3)]
    expected = ref.encode(images)  # default pooling for CLIP: "model" (image_embeds)
    with httpx.Client(base_url=app.base_url, timeout=120) as client:
        body = {"input": ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]}
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        got = [np.asarray(d["embedding"], dtype=np.float32) for d in r.json()["data"]]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-4)
        r = client.post("/v1/embeddings", json={**body, "pooling": "mean-l2"})
        assert r.status_code == 200, r.text
        assert abs(np.linalg.norm(r.json()["data"][0]["embedding"]) - 1) < 1e-4
    vectors = app.handle.embed.remote(images).result()
    for g, e in zip(vectors, expected, strict=True):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-4)


def test_text_on_a_model_without_a_tokenizer_is_text_not_supported(app):
    """A preset has no tokenizer: it serves images only, says so in /v1/models, and text is a 400."""
    with httpx.Client(base_url=app.base_url, timeout=120) as client:
        (model,) = client.get("/v1/models").json()["data"]
        assert model["input_types"] == ["image"]
        for body in ({"input": [{"text": "a cat"}]}, {"input": "a cat", "input_type": "text"}):
            r = client.post("/v1/embeddings", json=body)
            assert r.status_code == 400, r.text
            assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("text_not_supported", "input")
    with pytest.raises(Exception, match="takes no text") as info:
        app.handle.embed_text.remote(["a cat"]).result()
    assert getattr(info.value, "code", None) == "text_not_supported"
