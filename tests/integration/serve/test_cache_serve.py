"""The encoder cache through the running service (issue 47 item 3): repeated requests answered byte-identically
without reaching the encoder replica again (its own request count stays put; the ingress counts the hits), over
HTTP and through the handle, the bypass, and the benchmark's smoke run (benchmarks/cache.py). Units:
tests/unit/deployments/ingress/test_cache_units.py."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import orjson
import pytest
from ray import serve

from deployments.config import ENCODER_NAME
from tests.images_util import encode, random_image

APP_ARGS = {"model": "tiny", "num_replicas": 1, "cache_mib": 8, "max_request_images": 8}
NAME = "vision-cache"


@pytest.fixture(scope="module")
def app(ray_cluster):
    from deployments import build_app
    from tests.serve_fixtures import running_app

    with running_app(build_app(APP_ARGS), name=NAME) as svc:
        yield svc


def encoder_images() -> int:
    """Images the encoder replica has encoded in its batches (its own count, health probes apart: a hit never
    reaches it)."""
    return serve.get_deployment_handle(ENCODER_NAME, NAME).stats.remote().result()["batched_images"]


def ingress_stats(app) -> dict:
    return app.handle.ingress_stats.remote().result()


def png(seed: int, side: int = 64) -> bytes:
    return encode(random_image("RGB", side, side, seed), "PNG")


def post(app, body: dict) -> httpx.Response:
    return httpx.post(f"{app.base_url}/v1/embeddings", json=body, timeout=60)


def test_repeated_http_requests_are_answered_byte_identically_without_the_encoder(app):
    images = [base64.b64encode(png(s)).decode() for s in (1, 2)]
    body = {"input": images, "encoding_format": "base64"}
    first = post(app, body)
    assert first.status_code == 200, first.text
    before, stats = encoder_images(), ingress_stats(app)
    for _ in range(3):
        again = post(app, body)
        assert again.content == first.content  # the same bytes, usage included
    # the same image as a data URL and in another order: hits too
    swapped = post(app, {"input": [f"data:image/png;base64,{images[1]}", images[0]], "encoding_format": "base64"})
    data = orjson.loads(swapped.content)["data"]
    assert [d["embedding"] for d in data] == [d["embedding"] for d in orjson.loads(first.content)["data"]][::-1]
    assert encoder_images() == before  # no request reached the replica
    after = ingress_stats(app)
    assert after["cache_hits"] - stats["cache_hits"] == 8 and after["cache_misses"] == stats["cache_misses"]
    assert 0 < after["cache"]["bytes"] <= APP_ARGS["cache_mib"] * 2**20
    # the bypass computes again, and answers the same
    fresh = post(app, body | {"cache": False})
    assert fresh.content == first.content and encoder_images() == before + 2


def test_handle_calls_hit_the_same_cache(app):
    arr = np.asarray(random_image("RGB", 48, 40, 7))
    first = app.handle.embed_llm.remote([arr], dtype="bfloat16").result()
    before = encoder_images()
    again = app.handle.embed_llm.remote([arr.copy()], dtype="bfloat16").result()
    assert encoder_images() == before
    assert again[0]["tokens"].tobytes() == first[0]["tokens"].tobytes() and again[0]["grid_thw"] == first[0]["grid_thw"]
    # as an uncached answer comes (Ray hands numpy arrays over read-only, in place)
    assert again[0]["tokens"].flags.writeable == first[0]["tokens"].flags.writeable
    # encoded bytes sent through the handle share the HTTP entry of the same image (a base64 string there)
    data = png(3)
    assert post(app, {"input": base64.b64encode(data).decode()}).status_code == 200
    before = encoder_images()
    app.handle.embed.remote([data]).result()
    pooled = app.handle.embed.remote([data], cache=False).result()
    assert encoder_images() == before + 1  # only the bypass ran
    np.testing.assert_array_equal(app.handle.embed.remote([data]).result()[0], pooled[0])


def test_the_benchmark_smoke_run(app, capsys):
    from benchmarks import cache as bench

    assert bench.main(["--smoke"], base_url=app.base_url) == 0
    out = capsys.readouterr().out
    assert "answers byte-identical: True" in out and "| cached |" in out
