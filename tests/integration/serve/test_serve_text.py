"""Text through the running app (CPU Ray): a tiny CLIPModel checkpoint with its tokenizer, written by transformers
(`tests/text_checkpoints.py`). Mixed text / image requests answered in order and equal to `encoder.load`'s
`encode_text` / `encode` of the same checkpoint; `input_type: "text"` with the openai client; the text errors (4xx
with their codes); `usage.prompt_tokens`; `GET /v1/models`; the handle's `embed_text`; `examples/search.py` against
the app."""

from __future__ import annotations

import base64
import importlib.util
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

import encoder
from encoder.errors import InvalidArgumentError
from tests.images_util import encode, random_image
from tests.serve_fixtures import running_apps
from tests.text_checkpoints import write_clip

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TEXTS = ["a red bicycle", "a photo of a cat", "Ünïcode façade — 東京 😀", "cat " * 40]  # the last over-long


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip-text")
    write_clip(directory)
    return directory


@pytest.fixture(scope="module")
def ref(clip_dir):
    return encoder.load(clip_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def apps(ray_cluster, clip_dir):
    """The checkpoint served with its text side ("text", at /) and with `text=false` ("text-off", at /text-off),
    deployed side by side (`running_apps`): the second's start-up overlaps the first's instead of following it."""
    from deployments import build_app

    args = {"model": str(clip_dir), "num_replicas": 1, "dtype": "float32"}
    with running_apps(
        [(build_app(args), "text", "/"), (build_app({**args, "text": False}), "text-off", "/text-off")]
    ) as svcs:
        yield svcs


@pytest.fixture(scope="module")
def app(apps):
    return apps[0]


@pytest.fixture(scope="module")
def text_off_app(apps):
    """The `text=false` app; its `base_url` ends in its prefix /text-off."""
    return apps[1]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_a_mixed_request_is_answered_in_order_with_the_models_own_embeddings(app, ref):
    images = [encode(random_image("RGB", 40 + 20 * i, 70, seed=i), "PNG") for i in range(2)]
    texts = ref.encode_text(TEXTS)
    pictures = ref.encode(images)
    assert all(float(np.abs(v.numpy()).max()) > 0 for v in texts + pictures)  # references, never zeros
    body = {"input": [{"text": TEXTS[0]}, {"image": data_url(images[0])}, {"text": TEXTS[1]}, data_url(images[1]),
                      {"text": TEXTS[2]}, {"text": TEXTS[3]}]}  # fmt: skip
    with httpx.Client(base_url=app.base_url, timeout=120) as client:
        r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(6))
    want = [texts[0], pictures[0], texts[1], pictures[1], texts[2], texts[3]]
    for d, w in zip(data, want, strict=True):
        close(d["embedding"], w.numpy())
    patches = int(ref.preprocess(images).grid_thw.prod(-1).sum())
    tokens = sum(ref.text_tokens(TEXTS))
    assert tokens < len(TEXTS) * ref.text.config.seq_len  # real tokens, not the padded length
    assert r.json()["usage"] == {"prompt_tokens": tokens + patches, "total_tokens": tokens + patches}


def test_input_type_text_with_the_openai_client(app, ref):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model=str(app_model(app)), input=TEXTS[:2], extra_body={"input_type": "text"})
    for item, want in zip(out.data, ref.encode_text(TEXTS[:2]), strict=True):
        close(item.embedding, want.numpy())  # the client asks for base64 and decodes it
    out = client.embeddings.create(
        model=str(app_model(app)), input=[TEXTS[0]], extra_body={"input_type": "text", "pooling": "model-l2"}
    )
    close(out.data[0].embedding, ref.encode_text(TEXTS[:1], pooling="model-l2")[0].numpy())
    assert abs(np.linalg.norm(out.data[0].embedding) - 1) < 1e-4


def app_model(app) -> str:
    with httpx.Client(base_url=app.base_url, timeout=60) as client:
        (model,) = client.get("/v1/models").json()["data"]
    return model["id"]


def test_v1_models_says_the_model_takes_text(app):
    with httpx.Client(base_url=app.base_url, timeout=60) as client:
        (model,) = client.get("/v1/models").json()["data"]
    assert model["input_types"] == ["image", "text"]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"input": [{"text": "a"}, {"text": ""}]}, 400, "invalid_text", "input[1]"),
        ({"input": ["", "b"], "input_type": "text"}, 400, "invalid_text", "input[0]"),
        ({"input": [{"text": 7}]}, 400, "invalid_text", "input[0]"),
        ({"input": [{"text": "a"}], "pooling": "mean"}, 400, "invalid_pooling", "pooling"),
        ({"input": [{"text": "a"}], "pooling": "none"}, 400, "invalid_pooling", "pooling"),
        ({"input": [{"text": "a"}], "dimensions": 7}, 400, "invalid_dimensions", "dimensions"),
        ({"input": [{"words": "a"}]}, 422, "invalid_schema", "input[0]"),
        ({"input": ["a"], "input_type": "audio"}, 422, "invalid_schema", "input_type"),
        ({"input": [{"video": "AAAA"}]}, 400, "video_not_supported", "input"),  # a CLIP tower takes no video
    ],
)
def test_text_errors_are_4xx_with_their_codes(app, body, status, code, param):
    with httpx.Client(base_url=app.base_url, timeout=60) as client:
        r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error


def test_embed_text_handle_equals_encode_text(app, ref):
    got = app.handle.embed_text.remote(TEXTS).result()
    assert len(got) == len(TEXTS) and all(v.dtype == np.float32 for v in got)
    for g, w in zip(got, ref.encode_text(TEXTS), strict=True):
        close(g, w.numpy())
    (one,) = app.handle.embed_text.remote(TEXTS[1], pooling="model-l2").result()
    close(one, ref.encode_text([TEXTS[1]], pooling="model-l2")[0].numpy())
    with pytest.raises(InvalidArgumentError, match=r"texts\[1\] is an empty string"):
        app.handle.embed_text.remote(["a", ""]).result()
    with pytest.raises(InvalidArgumentError, match="applies to images only"):
        app.handle.embed_text.remote(["a"], pooling="mean").result()


def test_concurrent_text_and_image_handle_calls_each_get_their_own(app, ref):
    """Text and image calls in flight together (merged at the ingress, batched on the replica): none is mixed
    into the other's batch, each gets its own answer."""
    images = [encode(random_image("RGB", 56, 56, seed=10 + i), "PNG") for i in range(4)]
    text_calls = [app.handle.embed_text.remote([t]) for t in TEXTS]
    image_calls = [app.handle.embed.remote([x]) for x in images]
    for call, want in zip(text_calls, ref.encode_text(TEXTS), strict=True):
        close(call.result()[0], want.numpy())
    for call, want in zip(image_calls, ref.encode(images), strict=True):
        close(call.result()[0], want.numpy())


def test_text_off_serves_the_same_model_for_images_only(text_off_app, ref):
    """`text=false`: a text-capable checkpoint served for images only. Its replicas load no text side
    (`describe()["text"]` None), /v1/models lists images only, a text item or `embed_text` is 400
    `text_not_supported` saying text is off, images are answered with the model's own embeddings."""
    from ray import serve

    from deployments.config import ENCODER_NAME
    from deployments.errors import RequestError

    svc = text_off_app
    encoder_handle = serve.get_deployment_handle(ENCODER_NAME, app_name=svc.name)
    assert encoder_handle.describe.remote().result()["text"] is None
    image = encode(random_image("RGB", 48, 64, seed=3), "PNG")
    base_url = svc.base_url
    with httpx.Client(base_url=base_url, timeout=120) as client:
        (model,) = client.get("/v1/models").json()["data"]
        assert model["input_types"] == ["image"]
        r = client.post("/v1/embeddings", json={"input": [{"text": TEXTS[0]}, {"image": data_url(image)}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("text_not_supported", "input")
        assert "text is off for this deployment" in error["message"], error
        r = client.post("/v1/embeddings", json={"input": [data_url(image)], "encoding_format": "float"})
        assert r.status_code == 200, r.text
    close(r.json()["data"][0]["embedding"], ref.encode([image])[0].numpy())
    with pytest.raises(RequestError, match="text is off for this deployment") as info:
        svc.handle.embed_text.remote(TEXTS[:1]).result()
    assert info.value.code == "text_not_supported"


# ------------------------------------------------------------------------------------- examples/search.py


def test_search_example_ranks_by_the_models_own_cosines(app, clip_dir, ref, tmp_path):
    """`examples/search.py` (docs/search.md) against the running service: the batch job embeds a folder of images, the
    service embeds text (and image) queries, and the ranking equals the cosines of `encoder.load`'s own image and
    text embeddings. (Here, not in a module of its own, to share this module's checkpoint and application.)"""
    spec = importlib.util.spec_from_file_location("example_search", EXAMPLES / "search.py")
    search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(search)
    photos = tmp_path / "photos"
    (photos / "more").mkdir(parents=True)
    shutil.copy(EXAMPLES / "images" / "gradient.jpg", photos / "gradient.jpg")
    for i in range(5):
        (photos / ("more" if i % 2 else ".") / f"img{i}.png").write_bytes(
            encode(random_image("RGB", 40 + 15 * i, 80 - 7 * i, seed=i), "PNG")
        )
    (photos / "notes.txt").write_text("not an image")  # not picked up
    queries = ["a photo of a cat", "a red bicycle", str(photos / "img2.png")]
    results = search.main(app.base_url, photos, str(clip_dir), queries, top_k=6)

    paths = sorted(str(p.resolve()) for p in photos.rglob("*") if p.suffix in (".jpg", ".png"))
    images = ref.encode([Path(p).read_bytes() for p in paths], pooling="model-l2")
    want_vectors = [*ref.encode_text(queries[:2], pooling="model-l2"), images[paths.index(queries[2])]]
    image_matrix = np.stack([v.numpy() for v in images])
    for q, vec in zip(queries, want_vectors, strict=True):
        cosines = image_matrix @ vec.numpy()
        order = np.argsort(-cosines, kind="stable")
        got = results[q]
        assert len(got) == 6
        np.testing.assert_allclose([s for _, s in got], cosines[order], atol=1e-4)
        # the same ranking (ties within the tolerance may swap)
        for (path, score), i in zip(got, order, strict=True):
            assert path == paths[i] or abs(score - cosines[i]) < 1e-4
    assert results[queries[2]][0] == (queries[2], pytest.approx(1.0, abs=1e-4))  # an image finds itself
