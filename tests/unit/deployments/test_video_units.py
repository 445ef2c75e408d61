"""Video in the service without Ray (issue 47 item 1): the wire's patch count, the replica's shape checks and its
mixed image / video patchify, the ingress's video strings, item order and labels, the error table's video codes,
the video decode pool (PyAV in a worker process, timestamps back with the frames) and `/v1/models`'s
`input_types`."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import orjson
import pytest
import torch
from starlette.requests import Request

from deployments.errors import ErrorCode, RequestError, classify
from deployments.ingress.decode_pool import DecodePool, decode_video_frames
from deployments.ingress.inputs import parse_video_string
from deployments.ingress.lifecycle import EmbedOrder
from deployments.replica.pipeline import check_pixels
from deployments.wire import patch_count
from encoder.errors import (
    DecodeTimeoutError,
    InvalidImageError,
    InvalidVideoError,
    VideoDecodeError,
    VideoTooLargeError,
)
from encoder.patchify import patchify, patchify_video, stack_patchify
from encoder.preprocessing.qwen import PreprocessConfig as QwenPreprocessConfig
from encoder.preprocessing.video import VideoPreprocessConfig
from encoder.preprocessing.video_decode import load_video
from tests.unit.deployments.ingress.test_text_requests_units import TextClient, routes
from tests.video_util import make_video

VCFG = VideoPreprocessConfig.defaults("qwen3")
PP = QwenPreprocessConfig(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def test_patch_count_of_images_and_videos():
    assert patch_count(np.zeros((64, 96, 3), np.uint8), 16) == 4 * 6
    assert patch_count(np.zeros((5, 64, 96, 3), np.uint8), 16, 2) == 3 * 4 * 6  # an odd count padded
    h, w = VCFG.target_size(5, 64, 96)
    assert patch_count(np.zeros((5, h, w, 3), np.uint8), 16, 2) == int(np.prod(VCFG.grid(5, 64, 96)))


def test_replica_check_pixels_takes_videos_only_with_a_video_processor():
    video = np.zeros((4, 64, 32, 3), np.uint8)
    arrays, counts = check_pixels([np.zeros((32, 32, 3), np.uint8), video], PP, VCFG)
    assert counts == [4, 2 * 4 * 2] and arrays[1] is video
    with pytest.raises(InvalidVideoError, match=r"pixels\[0\].*takes no video"):
        check_pixels([video], PP, None)
    with pytest.raises(InvalidVideoError, match=r"pixels\[0\]"):
        check_pixels([np.zeros((4, 40, 32, 3), np.uint8)], PP, VCFG)  # 40 not a multiple of 32
    with pytest.raises(InvalidVideoError):
        check_pixels([np.zeros((0, 32, 32, 3), np.uint8)], PP, VCFG)
    with pytest.raises(InvalidImageError):
        check_pixels([np.zeros((32, 32), np.uint8)], PP, VCFG)


def test_stack_patchify_of_images_and_videos_is_the_concatenation():
    rng = np.random.default_rng(0)
    items = [
        rng.integers(0, 256, (32, 64, 3), dtype=np.uint8),
        rng.integers(0, 256, (3, 64, 32, 3), dtype=np.uint8),
        rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
        rng.integers(0, 256, (32, 64, 3), dtype=np.uint8),
        rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
    ]
    batch = stack_patchify(items, PP, torch.device("cpu"), VCFG)
    want = [
        patchify_video(torch.from_numpy(x), VCFG) if x.ndim == 4 else patchify(torch.from_numpy(x), PP) for x in items
    ]
    assert torch.equal(batch.pixel_values, torch.cat(want))
    assert batch.grid_thw.tolist() == [[1, 2, 4], [2, 4, 2], [1, 4, 4], [1, 2, 4], [2, 2, 2]]
    assert batch.grid_thw.dtype == torch.int64
    images_only = stack_patchify([items[0], items[2]], PP, torch.device("cpu"), VCFG)
    assert torch.equal(images_only.pixel_values, torch.cat([want[0], want[2]]))


def test_video_strings():
    data = b"\x00\x00\x00\x18ftypmp42 some video"
    b64 = base64.b64encode(data).decode()
    assert parse_video_string(f"data:video/mp4;base64,{b64}", 1000) == data
    assert parse_video_string(b64, 1000) == data
    with pytest.raises(RequestError) as e:
        parse_video_string(f"data:image/png;base64,{b64}", 1000)
    assert e.value.error is ErrorCode.UNSUPPORTED_MEDIA_TYPE
    with pytest.raises(RequestError) as e:
        parse_video_string("https://example.com/a.mp4", 1000)
    assert e.value.error is ErrorCode.INVALID_IMAGE_URL
    with pytest.raises(VideoTooLargeError):
        parse_video_string(b64, 10)
    with pytest.raises(RequestError) as e:
        parse_video_string("data:video/mp4;base64,@@@", 1000)
    assert e.value.error is ErrorCode.INVALID_BASE64


def test_order_and_labels_of_mixed_items():
    order = EmbedOrder(["i0", "i1"], videos=["v0"], texts=["t0"], kinds=["video", "image", "text", "image"],
                       label="input")  # fmt: skip
    assert order.ordered(["I0", "I1"], ["T0"], ["V0"]) == ["V0", "I0", "T0", "I1"]
    assert order.image_label()(1) == "input[3]" and order.image_label("video")(0) == "input[0]"
    handle = EmbedOrder(["i0"], videos=["v0", "v1"])
    assert handle.ordered(["I0"], [], ["V0", "V1"]) == ["I0", "V0", "V1"]
    assert handle.image_label() == "images" and handle.image_label("video") == "videos"
    videos_only = EmbedOrder([], videos=["v0"], kinds=["video"], label="input")
    assert videos_only.image_label("video") == "input"


@pytest.mark.parametrize(
    "exc, code, status",
    [
        (VideoDecodeError("x"), ErrorCode.INVALID_VIDEO, 400),
        (InvalidVideoError("x"), ErrorCode.INVALID_VIDEO, 400),
        (VideoTooLargeError("x"), ErrorCode.VIDEO_TOO_LARGE, 413),
        (DecodeTimeoutError("x"), ErrorCode.IMAGE_DECODE_TIMEOUT, 413),
    ],
)
def test_video_errors_have_codes(exc, code, status):
    assert classify(exc).error is code and code.status == status


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_video_decode_pool_returns_frames_and_timestamps(kind):
    """A video's facts come back with its frames, None included (a Qwen2-VL video has no timestamps)."""
    cfg = VideoPreprocessConfig.defaults(kind)
    data = make_video(9, 48, 64, fps=10)
    want = load_video(data, cfg)
    with DecodePool(1, cfg=cfg, decode_fn=decode_video_frames, context="spawn") as pool:
        got, stamps = asyncio.run(pool.decode_async(data, 30.0))
        assert np.array_equal(got, want.frames) and stamps == want.timestamps
        assert (stamps is None) == (kind == "qwen2")
        with pytest.raises(VideoDecodeError):
            pool.decode(data[: len(data) // 2], 30.0)


# ------------------------------------------------------------------------------------------ HTTP items


def test_http_video_items_parse_in_order():
    from deployments.ingress.openai_api import input_items, parse_embedding_request

    body = b'{"input": [{"video": "AAAA"}, {"image": "BBBB"}, {"text": "t"}, {"video": "CCCC"}], "pooling": "mean"}'
    parsed = parse_embedding_request(body)
    items = input_items(parsed.input, parsed.input_type)
    assert items.videos == ["AAAA", "CCCC"] and items.images == ["BBBB"] and items.texts == ["t"]
    assert items.kinds == ["video", "image", "text", "video"] and len(items) == 4
    plain = input_items(["AAAA"], "video")
    assert plain.videos == ["AAAA"] and plain.kinds == ["video"]
    with pytest.raises(RequestError) as e:
        input_items([{"video": 3}])
    assert e.value.error is ErrorCode.INVALID_SCHEMA and "input[0].video must be a string" in str(e.value)
    with pytest.raises(RequestError) as e:
        input_items([{"audio": "x"}])
    assert '"video"' in str(e.value)


def test_http_answer_of_a_video_carries_its_grid_and_timestamps():
    import orjson

    from deployments.ingress.openai_api import embeddings_body

    tokens = np.ones((4, 3), np.float32)
    video = (tokens, [], (2, 2, 4), [0.25, 1.25])
    image = (tokens, [], (1, 4, 4), None)
    body = orjson.loads(embeddings_body([image, video, (tokens, [], (1, 4, 4))], "float", "m", 40))
    assert "timestamps" not in body["data"][0] and "timestamps" not in body["data"][2]
    assert body["data"][1]["timestamps"] == [0.25, 1.25] and body["data"][1]["grid_thw"] == [2, 2, 4]
    b64 = orjson.loads(embeddings_body([video], "base64", "m", 16))
    assert b64["data"][0]["timestamps"] == [0.25, 1.25] and b64["usage"]["prompt_tokens"] == 16


# ------------------------------------------------------------------------------------------ batch


def test_batch_video_column_options_and_decode_rows():
    import pyarrow as pa

    from deployments.batch.columns import ERROR, FRAMES, HEIGHT, PATCHES, PIXELS, WIDTH
    from deployments.batch.decode import decode_batch
    from deployments.batch.model_facts import typical_video_patches
    from deployments.batch.options import EmbedOptions

    o = EmbedOptions.of(model="tiny-qwen3-vl", video_column="clip")
    assert o.image_column == "clip" and EmbedOptions.of(**o.model_dump()).image_column == "clip"
    with pytest.raises(Exception, match="video_column and text_column"):
        EmbedOptions.of(video_column="clip", text_column="t")
    assert typical_video_patches(VCFG) == VCFG.max_pixels // 16**2

    good = make_video(9, 48, 64, fps=10)
    table = pa.table({"id": [0, 1, 2], "clip": pa.array([good, good[:300], None], pa.binary())})
    out = decode_batch(table, image_column="clip", pp=PP, path_root=None, video_cfg=VCFG)
    want = load_video(good, VCFG).frames
    n, h, w, _ = want.shape
    assert out.column(FRAMES).to_pylist() == [n, 0, 0] and out.column(HEIGHT).to_pylist()[0] == h
    assert out.column(WIDTH).to_pylist()[0] == w
    assert out.column(PATCHES).to_pylist() == [patch_count(want, 16, 2), 0, 0]
    assert out.column(PIXELS).to_pylist()[0] == want.tobytes()
    errors = out.column(ERROR).to_pylist()
    assert errors[0] is None and errors[1].startswith("VideoDecodeError") and errors[2].startswith("ImageDecodeError")
    assert "clip" not in out.column_names


def test_video_decode_pool_applies_the_limits_and_reports_their_codes():
    from encoder.preprocessing.video import VideoLimits

    data = make_video(9, 48, 64, fps=10)
    cases = [
        (VideoLimits(max_frame_pixels=1000), VideoTooLargeError, ErrorCode.VIDEO_TOO_LARGE),
        (VideoLimits(max_frames=5), VideoTooLargeError, ErrorCode.VIDEO_TOO_LARGE),
        (VideoLimits(max_duration_s=0.5), VideoTooLargeError, ErrorCode.VIDEO_TOO_LARGE),
        (VideoLimits(max_decode_s=1e-9), DecodeTimeoutError, ErrorCode.IMAGE_DECODE_TIMEOUT),
    ]
    for limits, error, code in cases:
        cfg = VideoPreprocessConfig.defaults("qwen3", limits=limits)
        with DecodePool(1, cfg=cfg, decode_fn=decode_video_frames, context="spawn") as pool:
            with pytest.raises(error) as info:
                pool.decode(data, 30.0)
        assert classify(info.value).error is code, limits


def test_v1_models_lists_video_where_the_model_takes_it():
    """`input_types` has "video" when the replica's `describe()` has a video processor (a Qwen tower), with or
    without the text side, `text=false` included; the field is absent while no encoder replica answers."""

    class Encoder(TextClient):
        def __init__(self, text: bool, video: bool):
            super().__init__(text)
            self.video = video

        async def info(self) -> dict:
            return await super().info() | {"video_config": VCFG if self.video else None}

    class Down(TextClient):
        async def info(self) -> dict:
            raise ConnectionError("no encoder replica yet")

    request = Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": []})

    def listed(client, **args) -> dict:
        (model,) = orjson.loads(asyncio.run(routes(client, **args).models(request)).body)["data"]
        return model

    assert listed(Encoder(text=False, video=True))["input_types"] == ["image", "video"]  # Qwen-VL
    assert listed(Encoder(text=False, video=False))["input_types"] == ["image"]  # DINOv2
    assert listed(Encoder(text=True, video=False))["input_types"] == ["image", "text"]  # CLIP
    assert listed(Encoder(text=True, video=True))["input_types"] == ["image", "text", "video"]
    assert listed(Encoder(text=True, video=True), text=False)["input_types"] == ["image", "video"]
    assert "input_types" not in listed(Down())
