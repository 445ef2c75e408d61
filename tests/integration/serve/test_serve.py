"""The Serve application on CPU Ray: HTTP (OpenAI shape), the openai client, handles, errors, health.

One deployment for the module: the `tiny` preset, two encoder replicas with the continuous batcher
and ingress merging (calls that queue while the ingress's merged requests are in flight go together).
Service embeddings are compared
with `VisionEncoder.encode` on the same images (same preset and seed: same random weights).
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

import encoder
from encoder.errors import EncoderError, ImageDecodeError, InvalidImageError
from tests.images_util import encode, png_bomb_header, random_array, random_image
from tests.serve_fixtures import app_fixture

pytestmark = pytest.mark.slow

APP_ARGS = {
    "model": "tiny",
    "num_replicas": 2,
    "batcher": "continuous",
    "pipeline_depth": 2,  # two batches in flight per replica, as on a GPU
    "max_request_images": 8,
}
ATOL = 1e-4


app = app_fixture(APP_ARGS, "vision")


@pytest.fixture(scope="module")
def reference():
    return encoder.load("tiny")


@pytest.fixture(scope="module")
def client(app):
    with httpx.Client(base_url=app.base_url, timeout=120) as c:
        yield c


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png(h: int, w: int, seed: int = 0) -> bytes:
    return encode(random_image("RGB", h, w, seed), "PNG")


def jpeg(h: int, w: int, seed: int = 0) -> bytes:
    return encode(random_image("RGB", h, w, seed), "JPEG", quality=90)


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error
    return error


# ------------------------------------------------------------------------------------------ HTTP


def test_http_png_and_jpeg_data_urls_match_the_encoder(client, reference):
    images = [png(70, 90, 1), jpeg(120, 64, 2), png(56, 56, 3)]
    inputs = [data_url(images[0]), data_url(images[1], "image/jpeg"), base64.b64encode(images[2]).decode()]
    r = client.post("/v1/embeddings", json={"model": "tiny", "input": inputs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    expected = reference.encode(images, pooling="mean")
    for item, ref in zip(body["data"], expected, strict=True):
        assert item["object"] == "embedding"
        np.testing.assert_allclose(np.array(item["embedding"], dtype=np.float32), ref.numpy(), atol=ATOL)
    patches = sum(reference.preprocess([x]).pixel_values.shape[0] for x in images)
    assert body["usage"] == {"prompt_tokens": patches, "total_tokens": patches}


def test_http_single_string_base64_format_and_per_token_output(client, reference):
    image = jpeg(100, 150, 4)
    r = client.post(
        "/v1/embeddings", json={"input": data_url(image, "image/jpeg"), "encoding_format": "base64", "pooling": "none"}
    )
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    tokens = reference.encode([image], pooling="none")[0].numpy()
    assert item["shape"] == list(tokens.shape)
    got = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").reshape(item["shape"])
    np.testing.assert_allclose(got, tokens, atol=ATOL)

    r = client.post("/v1/embeddings", json={"input": [data_url(image)], "pooling": "none"})
    np.testing.assert_allclose(np.array(r.json()["data"][0]["embedding"], dtype=np.float32), tokens, atol=ATOL)


def test_openai_client(app, reference):
    from openai import OpenAI

    oa = OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=120)
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    images = [png(64, 64, 5), jpeg(84, 112, 6)]
    urls = [data_url(images[0]), data_url(images[1], "image/jpeg")]
    expected = reference.encode(images, pooling="mean")
    # Without encoding_format the client asks for base64 and decodes it itself; "float" is plain JSON.
    for kwargs in ({}, {"encoding_format": "float"}):
        response = oa.embeddings.create(model="tiny", input=urls, **kwargs)
        assert len(response.data) == 2 and response.usage.prompt_tokens > 0
        for item, ref in zip(response.data, expected, strict=True):
            np.testing.assert_allclose(np.asarray(item.embedding, dtype=np.float32), ref.numpy(), atol=ATOL)


def test_health_and_models(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    r = client.head("/health")  # some load balancers probe with HEAD (broken: 405)
    assert r.status_code == 200 and r.content == b"", r.status_code
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [(m["id"], m["random_weights"]) for m in r.json()["data"]] == [("tiny", True)]
    # OpenAI's "retrieve model" (broken: 404 for the served model, so `client.models.retrieve("tiny")` failed)
    r = client.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json() == client.get("/v1/models").json()["data"][0], r.text
    r = client.get("/v1/models/org/other")  # ids may hold "/"
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert "'org/other' is not served here; available: 'tiny'" in r.json()["error"]["message"]


BAD_REQUESTS = [
    # (json body, status, error code)
    ({"input": ["data:image/png;base64,!!!not base64!!!"]}, 400, "invalid_base64"),
    ({"input": ["bm90IGJhc2U2NA="]}, 400, "invalid_base64"),  # bad padding
    ({"input": ["data:image/png;base64"]}, 400, "invalid_data_url"),  # no comma
    ({"input": ["data:image/png,rawbytes"]}, 400, "invalid_data_url"),  # not base64
    ({"input": ["data:text/plain;base64,aGVsbG8="]}, 415, "unsupported_media_type"),
    ({"input": ["https://example.com/cat.png"]}, 400, "invalid_image_url"),
    ({"input": [base64.b64encode(b"definitely not an image").decode()]}, 400, "invalid_image"),
    ({"input": [""]}, 400, "invalid_image"),
    ({"input": [data_url(png(40, 40)[:60])]}, 400, "invalid_image"),  # truncated PNG
    ({"input": [data_url(png(28, 28 * 300))]}, 400, "invalid_image"),  # aspect ratio over 200:1
    ({"input": [data_url(png_bomb_header(30000, 30000))]}, 413, "image_too_large"),
    ({"input": [data_url(png(28, 28))] * 9}, 413, "too_many_images"),
    ({"input": [data_url(png(28, 28))], "model": "gpt-4"}, 404, "model_not_found"),
    ({"input": [data_url(png(28, 28))], "dimensions": 7}, 400, "invalid_dimensions"),
    ({"input": []}, 422, "invalid_schema"),
    ({"input": 123}, 422, "invalid_schema"),
    ({"input": [1, 2, 3]}, 422, "invalid_schema"),
    ({"input": [[1, 2], [3]]}, 422, "invalid_schema"),
    ({}, 422, "invalid_schema"),
    ({"input": [data_url(png(28, 28))], "pooling": "max"}, 422, "invalid_schema"),
    ({"input": [data_url(png(28, 28))], "encoding_format": "int8"}, 422, "invalid_schema"),
]


@pytest.mark.parametrize(
    "body,status,code", BAD_REQUESTS, ids=[f"{s}-{c}-{i}" for i, (_, s, c) in enumerate(BAD_REQUESTS)]
)
def test_http_client_mistakes_are_4xx_error_objects(client, body, status, code):
    assert_error(client.post("/v1/embeddings", json=body), status, code)


def test_http_unsupported_format_invalid_json_and_unknown_route(client):
    ico = encode(random_image("RGB", 32, 32), "ICO")
    error = assert_error(client.post("/v1/embeddings", json={"input": [data_url(ico, "image/x-icon")]}), 415)
    assert error["code"] == "unsupported_image_format" and "ICO" in error["message"]
    r = client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert_error(client.get("/v1/nothing-here"), 404, "not_found")


def test_http_unknown_fields_are_refused_by_name(client):
    """Broken: ignored, so a misspelt extension gave another answer than the one asked for (`poolling: "none"`:
    mean vectors; `embeding_dtype: "bfloat16"`: float32 bytes that the client then read as bfloat16)."""
    good = data_url(png(56, 56))
    for field, value in (("poolling", "none"), ("embeding_dtype", "bfloat16")):
        error = assert_error(client.post("/v1/embeddings", json={"input": [good], field: value}), 422, "invalid_schema")
        assert error["message"].startswith(f"unknown field '{field}'; the fields are input, input_type, model,"), error
        assert error["param"] == field
    # every field the API has is accepted
    body = {"input": [good], "input_type": "image", "model": "tiny", "encoding_format": "float", "pooling": "mean",
            "dimensions": None, "embedding_dtype": "float32", "user": "u1"}  # fmt: skip
    assert client.post("/v1/embeddings", json=body).status_code == 200


def test_http_error_names_the_bad_input(client):
    good = data_url(png(56, 56))
    error = assert_error(client.post("/v1/embeddings", json={"input": [good, good, "%%%"]}), 400, "invalid_base64")
    assert error["message"].startswith("input[2]:") and error["param"] == "input"


# ------------------------------------------------------------------------------------------ handles


def test_handle_embed_accepts_bytes_pil_and_arrays(app, reference):
    arr = random_array(90, 60, 3, seed=7)
    pil = random_image("RGB", 64, 100, seed=8)
    data = png(77, 77, 9)
    out = app.handle.embed.remote([data, pil, arr]).result(timeout_s=120)
    expected = reference.encode([data, pil, arr], pooling="mean")
    assert [o.shape for o in out] == [(reference.out_dim,)] * 3
    for got, ref in zip(out, expected, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref.numpy(), atol=ATOL)
    (tokens,) = app.handle.embed.remote(arr, pooling="none").result(timeout_s=120)  # one image, not a list
    np.testing.assert_allclose(tokens, reference.encode([arr], pooling="none")[0].numpy(), atol=ATOL)
    assert app.handle.embed.remote([]).result(timeout_s=60) == []


def test_handle_large_call_is_split_across_requests(app, reference):
    # 40 images > the CPU batch limit (32 images): the ingress sends two encoder requests.
    images = [random_array(56, 56, 3, seed=100 + i) for i in range(40)]
    out = app.handle.embed.remote(images).result(timeout_s=180)
    expected = reference.encode(images, pooling="mean")
    np.testing.assert_allclose(np.stack(out), np.stack([e.numpy() for e in expected]), atol=ATOL)


def test_concurrent_handle_calls_are_merged_and_stay_in_order(app, reference):
    images = [random_array(56 + 28 * (i % 3), 84, 3, seed=200 + i) for i in range(24)]
    before = app.handle.ingress_stats.remote().result(timeout_s=30)
    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(lambda x: app.handle.embed.remote([x]).result(timeout_s=180), x) for x in images]
        out = [f.result()[0] for f in futures]
    after = app.handle.ingress_stats.remote().result(timeout_s=30)
    expected = reference.encode(images, pooling="mean")
    np.testing.assert_allclose(np.stack(out), np.stack([e.numpy() for e in expected]), atol=ATOL)
    calls = after["merged_calls"] - before["merged_calls"]
    requests = after["encoder_requests"] - before["encoder_requests"]
    assert calls == 24 and requests < calls, (calls, requests)


def test_handle_errors_are_encoder_errors_with_the_position(app):
    with pytest.raises(EncoderError) as info:
        app.handle.embed.remote([png(40, 40), b"garbage"]).result(timeout_s=60)
    assert isinstance(info.value, ImageDecodeError) and "images[1]" in str(info.value)
    with pytest.raises(InvalidImageError):
        app.handle.embed.remote([np.zeros((10, 10), dtype=np.float32)]).result(timeout_s=60)
    with pytest.raises(EncoderError, match="pooling"):
        app.handle.embed.remote([png(40, 40)], pooling="max").result(timeout_s=60)


def test_encoder_replica_direct_call_and_routing_stats(app, reference):
    from ray import serve

    from deployments.config import ENCODER_NAME
    from encoder.preprocessing.images import load_image
    from encoder.preprocessing.qwen import resize_image

    enc = serve.get_deployment_handle(ENCODER_NAME, app_name=app.name)
    pixels = [resize_image(load_image(random_array(60, 60, 3, seed=11))), resize_image(load_image(png(100, 40, 12)))]
    n = sum(x.shape[0] // 14 * x.shape[1] // 14 for x in pixels)
    out = enc.encode_pixels.remote(pixels, pooling="mean", num_patches=n).result(timeout_s=60)
    np.testing.assert_allclose(
        np.stack(out), np.stack([e.numpy() for e in reference.encode(pixels, pooling="mean")]), atol=ATOL
    )
    with pytest.raises(EncoderError, match="num_patches"):
        enc.encode_pixels.remote(pixels, num_patches=n + 1).result(timeout_s=60)
    with pytest.raises(InvalidImageError):
        enc.encode_pixels.remote([np.zeros((30, 28, 3), np.uint8)]).result(timeout_s=60)
    stats = enc.record_routing_stats.remote().result(timeout_s=30)
    assert stats["ready"] is True and stats["buckets"] == [[256, 1], [1024, 1]]
    info = enc.describe.remote().result(timeout_s=30)
    assert info["out_dim"] == reference.out_dim and info["graphs_captured"] is True
    # the tiny preset: random weights, and on CPU `auto` resolved every layer kind to the reference
    assert info["random_weights"] is True
    assert set(info["attention"]) == {"full", "window"} and all("sdpa" in v for v in info["attention"].values())
    # the replica's process runs with the short GIL switch interval (AppArgs.gil_switch_interval_s)
    stats = enc.stats.remote().result(timeout_s=30)
    assert stats["gil_switch_interval_s"] == pytest.approx(0.0005)
    assert stats["batches"] >= 1 and 0 < stats["launch_seconds"] <= stats["busy_seconds"], stats


def test_image_pixels_roundtrip_through_http_and_handle_agree(app, client):
    image = Image.fromarray(random_array(64, 96, 3, seed=13))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    http = client.post("/v1/embeddings", json={"input": [data_url(buf.getvalue())]}).json()["data"][0]["embedding"]
    (handle,) = app.handle.embed.remote([image]).result(timeout_s=60)
    np.testing.assert_allclose(np.array(http, dtype=np.float32), handle, atol=1e-6)


def test_ingress_reports_recent_phase_timings(app, client):
    """`ingress_stats()["timings_ms"]`: medians of the last requests' phases per route, which is how the service
    benchmark splits an idle request's time."""
    body = {"input": [data_url(png(56, 56, seed=21))]}
    assert client.post("/v1/embeddings", json=body).status_code == 200
    app.handle.embed.remote([random_array(56, 56, 3, seed=22)]).result(timeout_s=60)
    stats = app.handle.ingress_stats.remote().result(timeout_s=30)
    http, handle = stats["timings_ms"]["http"], stats["timings_ms"]["handle"]  # one ingress replica
    assert set(http) == {"total", "parse", "decode", "encode", "answer", "n"} and http["n"] >= 1, http
    assert 0 < http["encode"] < http["total"] and 0 < handle["encode"] < handle["total"], stats
    assert stats["timings_ms"]["inline_decode"]["n"] >= 1  # a small PNG is decoded on the event loop
