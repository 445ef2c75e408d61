"""Video through the running app (CPU Ray, issue 47 item 1): the `tiny-qwen3-vl` preset (DeepStack, timestamps);
short videos made with PyAV in the test (`tests/video_util.py`). HTTP `{"video": ...}` items mixed with images
and the handle's `embed(videos=...)` / `embed_llm(videos=...)` equal `VisionEncoder.encode` / `encode_llm` of
`preprocess_video` of the same bytes (same preset and seed: same random weights), in order with images;
`usage.prompt_tokens` counts the videos' patches; hostile videos get their 4xx (handle: their errors, naming the
video) while an image request keeps answering. A Qwen2.5-VL app (the `tiny` preset) answers a video's
`second_per_grid_ts` (handle, both layouts, and HTTP) where Qwen3-VL answers `timestamps`."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

import encoder
from encoder.errors import EncoderError, InvalidVideoError, VideoDecodeError
from tests.images_util import encode, random_array, random_image
from tests.serve_fixtures import running_apps
from tests.video_util import frames, make_video

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-vl"
ATOL = 1e-4


@pytest.fixture(scope="module")
def ref():
    return encoder.load(MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def apps(ray_cluster):
    """The Qwen3-VL app, and a Qwen2.5-VL one (the `tiny` preset) beside it at its own route prefix, deployed
    side by side (`running_apps`): the second's start-up overlaps the first's instead of following it."""
    from deployments import build_app

    args = {"num_replicas": 1, "dtype": "float32", "max_request_images": 8}
    specs = [(build_app({**args, "model": MODEL}), "video", "/"),
             (build_app({**args, "model": "tiny"}), "video-qwen25", "/qwen25")]  # fmt: skip
    with running_apps(specs) as services:
        yield services


@pytest.fixture(scope="module")
def app(apps):
    return apps[0]


@pytest.fixture(scope="module")
def clips() -> list[bytes]:
    return [make_video(9, 48, 64, fps=10), make_video(6, 40, 40, fps=4, seed=3)]


def close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32), atol=ATOL)


def test_embed_videos_and_images_in_order_equal_the_encoder(app, ref, clips):
    image = random_array(64, 96, seed=1)
    got = app.handle.embed.remote([image], pooling="mean", videos=clips).result()
    want_videos = ref.encode(ref.preprocess_video(clips), pooling="mean")
    want_image = ref.encode([image], pooling="mean")
    assert len(got) == 3
    close(got[0], want_image[0])
    for g, w in zip(got[1:], want_videos, strict=True):
        assert g.shape == tuple(w.shape)  # one vector per video
        close(g, w)


def test_embed_llm_videos_carry_grid_and_timestamps(app, ref, clips):
    got = app.handle.embed_llm.remote(videos=clips).result()
    batch = ref.preprocess_video(clips)
    want = ref.encode_llm(batch)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["grid_thw"] == list(w.grid_thw) and g["grid_thw"][0] > 1
        assert g["timestamps"] == pytest.approx(batch.timestamps_of(i))
        assert "second_per_grid_ts" not in g  # Qwen3-VL's prompt has timestamps instead
        close(g["tokens"], w.tokens)
        assert len(g["deepstack"]) == len(w.deepstack) > 0
        for a, b in zip(g["deepstack"], w.deepstack, strict=True):
            close(a, b)


def test_video_arrays_are_videos_at_24_fps(app, ref):
    clip = frames(8, 32, 48, seed=5)
    got = app.handle.embed.remote(videos=[clip], pooling="mean").result()
    close(got[0], ref.encode(ref.preprocess_video([clip], fps=24.0), pooling="mean")[0])


@pytest.mark.parametrize(
    "bad, error",
    [
        (lambda clip: clip[: len(clip) // 2], VideoDecodeError),  # truncated
        (lambda clip: b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, VideoDecodeError),  # a header, nothing else
        (lambda clip: b"not a video at all", VideoDecodeError),
        (lambda clip: np.zeros((0, 32, 32, 3), np.uint8), InvalidVideoError),  # zero frames
    ],
)
def test_hostile_videos_raise_naming_the_video_while_images_answer(app, clips, bad, error):
    with pytest.raises(EncoderError) as info:
        app.handle.embed.remote(videos=[clips[0], bad(clips[0])]).result()
    assert isinstance(info.value, error), repr(info.value)
    assert "videos[1]" in str(info.value)
    out = app.handle.embed.remote([random_array(32, 32, seed=2)]).result()
    assert out[0].ndim == 1


# ------------------------------------------------------------------------------------------ HTTP


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def image_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def post(app, body: dict) -> httpx.Response:
    with httpx.Client(base_url=app.base_url, timeout=120) as client:
        return client.post("/v1/embeddings", json=body)


def test_http_video_items_mixed_with_images(app, ref, clips):
    png = encode(random_image("RGB", 48, 80, seed=4), "PNG")
    items = [{"video": video_url(clips[0])}, {"image": image_url(png)}, {"video": base64.b64encode(clips[1]).decode()}]
    r = post(app, {"input": items, "pooling": "mean"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    videos = ref.preprocess_video(clips)
    image = ref.preprocess(png)
    want = ref.encode(videos, pooling="mean")
    close(data[0]["embedding"], want[0])
    close(data[1]["embedding"], ref.encode(image, pooling="mean")[0])
    close(data[2]["embedding"], want[1])
    patches = sum(videos.patch_counts()) + sum(image.patch_counts())
    assert r.json()["usage"]["prompt_tokens"] == patches
    with httpx.Client(base_url=app.base_url, timeout=30) as client:
        (model,) = client.get("/v1/models").json()["data"]
    assert model["input_types"] == ["image", "video"]  # a Qwen tower (this preset has no text side)


def test_http_video_llm_outputs_carry_grid_and_timestamps(app, ref, clips):
    r = post(app, {"input": [{"video": video_url(clips[0])}], "pooling": "none"})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    batch = ref.preprocess_video(clips[0])
    want = ref.encode_llm(batch)[0]
    assert item["grid_thw"] == list(want.grid_thw) and item["timestamps"] == pytest.approx(batch.timestamps_of(0))
    assert "second_per_grid_ts" not in item
    close(item["embedding"], want.tokens)


@pytest.fixture(scope="module")
def app25(apps):
    """The Qwen2.5-VL app (the `tiny` preset) beside the Qwen3-VL one; its `base_url` ends in its prefix /qwen25."""
    return apps[1]


def test_qwen25_video_llm_outputs_carry_second_per_grid_ts(app25, clips):
    """Each video's `second_per_grid_ts` (here 0.2 s and 0.5 s: temporal_patch_size over the sampled fps), as
    `encode_llm` gives it, with its own tokens: the handle's `embed_llm` in both layouts and HTTP's items; no
    `timestamps`, and none on an image."""
    ref = encoder.load("tiny", device="cpu", dtype="float32")
    batch = ref.preprocess_video(clips)
    want = ref.encode_llm(batch)
    seconds = [w.second_per_grid_ts for w in want]
    assert seconds == [batch.second_per_grid_ts_of(i) for i in range(len(clips))] and len(set(seconds)) == 2
    image = random_array(32, 48, seed=6)
    for layout, key in (("parts", "tokens"), ("vllm", "embeds")):
        got = app25.handle.embed_llm.remote([image], layout=layout, videos=clips).result()
        assert "second_per_grid_ts" not in got[0] and "timestamps" not in got[0]
        for g, w in zip(got[1:], want, strict=True):
            assert g["grid_thw"] == list(w.grid_thw) and g["grid_thw"][0] > 1 and "timestamps" not in g
            assert g["second_per_grid_ts"] == pytest.approx(w.second_per_grid_ts)
            close(g[key], w.tokens)
    png = encode(random_image("RGB", 32, 48, seed=8), "PNG")
    with httpx.Client(base_url=app25.base_url, timeout=120) as client:
        r = client.post("/v1/embeddings", json={"input": [{"video": video_url(clips[1])}, {"image": image_url(png)}],
                                                "pooling": "none"})  # fmt: skip
    assert r.status_code == 200, r.text
    video, picture = r.json()["data"]
    assert video["second_per_grid_ts"] == pytest.approx(want[1].second_per_grid_ts) and "timestamps" not in video
    assert video["grid_thw"] == list(want[1].grid_thw) and "second_per_grid_ts" not in picture
    close(video["embedding"], want[1].tokens)


@pytest.mark.parametrize(
    "payload, status, code",
    [
        (lambda clip: video_url(clip[: len(clip) // 2]), 400, "invalid_video"),  # truncated
        (lambda clip: video_url(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64), 400, "invalid_video"),  # no frames
        (lambda clip: video_url(make_video(1, 32, 32)), 400, "invalid_video"),  # one frame: Qwen3-VL needs 2
        (lambda clip: "data:image/png;base64," + base64.b64encode(clip).decode(), 415, "unsupported_media_type"),
        (lambda clip: "%%%", 400, "invalid_base64"),
        (lambda clip: 3, 422, "invalid_schema"),
    ],
)
def test_http_hostile_videos_are_4xx_while_images_answer(app, clips, payload, status, code):
    r = post(app, {"input": [{"image": image_url(encode(random_image("RGB", 32, 32), "PNG"))},
                             {"video": payload(clips[0])}]})  # fmt: skip
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    if status == 400 and code == "invalid_video":
        assert error["message"].startswith("input[1]")
    ok = post(app, {"input": [image_url(encode(random_image("RGB", 32, 32, seed=7), "PNG"))]})
    assert ok.status_code == 200, ok.text
