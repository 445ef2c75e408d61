"""Video in the service without Ray (issue 47 item 1): the wire's patch count, the replica's shape checks and its
mixed image / video patchify, the ingress's video strings, item order and labels, the error table's video codes,
the video decode pool (PyAV in a worker process, timestamps and second_per_grid_ts back with the frames), a video's
facts (Qwen3-VL's timestamps, Qwen2/2.5-VL's second_per_grid_ts) through the request lifecycle into the handle's and
HTTP's LLM outputs (both layouts), a batch job's video decode rows (the facts with the frames) and fact columns (the
schema, the manifest), and `/v1/models`'s `input_types`."""

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
    InvalidArgumentError,
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
def test_video_decode_pool_returns_frames_and_facts(kind):
    """A video's facts come back with its frames: Qwen3-VL's timestamps, Qwen2/2.5-VL's second_per_grid_ts (2
    frames per temporal patch over the 10 fps sampled: 0.2 s), the other None."""
    cfg = VideoPreprocessConfig.defaults(kind)
    data = make_video(9, 48, 64, fps=10)
    want = load_video(data, cfg)
    with DecodePool(1, cfg=cfg, decode_fn=decode_video_frames, context="spawn") as pool:
        got, (stamps, per_grid) = asyncio.run(pool.decode_async(data, 30.0))
        assert np.array_equal(got, want.frames)
        assert (stamps, per_grid) == (want.timestamps, want.second_per_grid_ts)
        assert (stamps is None, per_grid is None) == ((True, False) if kind == "qwen2" else (False, True))
        if kind == "qwen2":
            assert per_grid == pytest.approx(0.2)
        with pytest.raises(VideoDecodeError):
            pool.decode(data[: len(data) // 2], 30.0)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_ingress_prepare_videos_gives_frames_timestamps_and_second_per_grid_ts(kind):
    """`IngressDecoder.prepare_videos`: an encoded video (the video decode pool) and a frame array (taken at 24 fps)
    each as `(frames, timestamps, second_per_grid_ts)`, what `load_video` / `prepare_frames` give."""
    from concurrent.futures import ThreadPoolExecutor

    from deployments.ingress.decoding import IngressDecoder
    from deployments.ingress.security import UrlFetcher
    from deployments.metrics import RecentTimings
    from encoder.preprocessing.video import prepare_frames
    from tests.video_util import frames

    cfg = VideoPreprocessConfig.defaults(kind)
    data, clip = make_video(9, 48, 64, fps=10), frames(8, 32, 48, seed=5)
    want = [load_video(data, cfg), prepare_frames(clip, None, cfg)]
    with ThreadPoolExecutor(2) as threads:
        decoder = IngressDecoder(threads, UrlFetcher(()), 10**7, RecentTimings(), processes=1, timeout_s=30.0)
        decoder._pools["video"] = DecodePool(1, cfg=cfg, decode_fn=decode_video_frames, context="spawn")
        try:
            got = asyncio.run(decoder.prepare_videos([data, clip], cfg, "videos"))
        finally:
            decoder.close()
    for (f, stamps, per_grid), w in zip(got, want, strict=True):
        assert np.array_equal(f, w.frames) and (stamps, per_grid) == (w.timestamps, w.second_per_grid_ts)
        assert (per_grid is not None) == (kind == "qwen2") and (stamps is not None) == (kind == "qwen3")


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


def test_http_answer_of_a_video_carries_its_grid_timestamps_and_second_per_grid_ts():
    import orjson

    from deployments.ingress.openai_api import embeddings_body

    tokens = np.ones((4, 3), np.float32)
    video = (tokens, [], (2, 2, 4), [0.25, 1.25], None)  # Qwen3-VL: timestamps
    video25 = (tokens, [], (2, 2, 4), None, 0.5)  # Qwen2/2.5-VL: second_per_grid_ts
    image = (tokens, [], (1, 4, 4))
    body = orjson.loads(embeddings_body([image, video, video25], "float", "m", 40))
    facts = ("timestamps", "second_per_grid_ts")
    assert not any(k in body["data"][0] for k in facts)
    assert body["data"][1]["timestamps"] == [0.25, 1.25] and body["data"][1]["grid_thw"] == [2, 2, 4]
    assert "second_per_grid_ts" not in body["data"][1]
    assert body["data"][2]["second_per_grid_ts"] == 0.5 and "timestamps" not in body["data"][2]
    b64 = orjson.loads(embeddings_body([video, video25], "base64", "m", 16))
    assert b64["data"][0]["timestamps"] == [0.25, 1.25] and b64["usage"]["prompt_tokens"] == 16
    assert b64["data"][1]["second_per_grid_ts"] == 0.5 and "second_per_grid_ts" not in b64["data"][0]


class LLMVideoClient:
    """A Qwen2.5-VL-like encoder with a video processor: per image or video an LLM output, tokens [2, 4] of its first
    value (and one DeepStack layer of its negation), the grid t = 2 for a video."""

    async def info(self) -> dict:
        from tests.unit.deployments.ingress.test_cache_units import info

        return info(video_config=VCFG)

    async def encode(self, arrays, pooling, llm, deadline):
        from deployments.llm_outputs import to_wire

        out = []
        for a in arrays:
            v = np.full((2, 4), float(a.flat[0]), np.float32)
            out.append((to_wire(v, llm), [to_wire(-v, llm)], (2, 4, 4) if a.ndim == 4 else (1, 4, 4)))
        return out, 8 * len(arrays)


def test_video_facts_follow_their_videos_into_the_handle_and_http_llm_outputs():
    """The ingress's video facts (`prepare_videos`: per video its frames, timestamps, second_per_grid_ts) join that
    video's LLM outputs, in order beside images: the handle's `embed_llm` dicts (layouts parts and vllm) and HTTP's
    items carry Qwen2/2.5-VL's `second_per_grid_ts` as a float and Qwen3-VL's `timestamps`, each only where it is
    not None; images carry neither."""
    from deployments.config import AppArgs
    from deployments.ingress.deployment import vllm_item
    from deployments.ingress.handle_calls import HandleCalls
    from deployments.ingress.http_routes import HttpRoutes
    from deployments.ingress.limits import Admission
    from deployments.ingress.security import ApiKeyAuth
    from deployments.llm_outputs import handle_item
    from deployments.metrics import IngressTelemetry
    from tests.unit.deployments.ingress.test_cache_units import FakeDecoder
    from tests.unit.deployments.ingress.test_http_routes_units import post

    facts = {5: ([0.25, 1.25], None), 6: (None, 0.5), 7: (None, 0.25)}  # per video (its first byte): its facts

    async def prepare_videos(videos, vcfg, label):
        out = []
        for v in videos:
            value = v if isinstance(v, int) else base64.b64decode(v)[0]
            out.append((np.full((4, 32, 32, 3), value, np.uint8), *facts[value]))
        return out

    decoder = FakeDecoder()
    decoder.prepare_videos = prepare_videos
    parts = (LLMVideoClient(), decoder, Admission(8))
    handle = HandleCalls(AppArgs(), *parts, IngressTelemetry())
    image = np.full((4, 4, 3), 3, np.uint8)
    for layout, item in (("parts", handle_item), ("vllm", vllm_item)):
        got = [item(w) for w in asyncio.run(handle([image], "none", "float32", layout, videos=[5, 6, 7]))]
        first = [float(g["tokens" if layout == "parts" else "embeds"][0, 0]) for g in got]
        assert first == [3.0, 5.0, 6.0, 7.0], layout  # in order: the image, then the videos
        assert [g["grid_thw"] for g in got] == [[1, 4, 4]] + [[2, 4, 4]] * 3
        assert [g.get("timestamps") for g in got] == [None, [0.25, 1.25], None, None]
        assert [g.get("second_per_grid_ts") for g in got] == [None, None, 0.5, 0.25]
        assert "timestamps" not in got[2] and "second_per_grid_ts" not in got[0] and "second_per_grid_ts" not in got[1]

    http = HttpRoutes(AppArgs(), *parts, ApiKeyAuth(None), IngressTelemetry(), None, None)
    video = {"video": base64.b64encode(b"\x06 a Qwen2.5-VL video").decode()}
    png = base64.b64encode(b"\x03 an image").decode()
    for layout in ("parts", "vllm"):
        for encoding in ("float", "base64"):
            status, body = post(http, {"input": [video, {"image": png}], "pooling": "none", "encoding_format": encoding,
                                       "embedding_layout": layout})  # fmt: skip
            assert status == 200, body
            assert body["data"][0]["second_per_grid_ts"] == 0.5 and body["data"][0]["grid_thw"] == [2, 4, 4]
            assert "timestamps" not in body["data"][0]
            assert "second_per_grid_ts" not in body["data"][1] and body["data"][1]["grid_thw"] == [1, 4, 4]


# ------------------------------------------------------------------------------------------ batch


def test_batch_video_column_options_and_decode_rows():
    import pyarrow as pa

    from deployments.batch.columns import ERROR, FRAMES, HEIGHT, PATCHES, PER_GRID, PIXELS, STAMPS, WIDTH
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
    prepared = load_video(good, VCFG)
    want = prepared.frames
    n, h, w, _ = want.shape
    assert out.column(FRAMES).to_pylist() == [n, 0, 0] and out.column(HEIGHT).to_pylist()[0] == h
    assert out.column(WIDTH).to_pylist()[0] == w
    assert out.column(PATCHES).to_pylist() == [patch_count(want, 16, 2), 0, 0]
    assert out.column(PIXELS).to_pylist()[0] == want.tobytes()
    errors = out.column(ERROR).to_pylist()
    assert errors[0] is None and errors[1].startswith("VideoDecodeError") and errors[2].startswith("ImageDecodeError")
    assert "clip" not in out.column_names
    # the video's facts ride with its frames to the encoder actor (float32; null for error rows and where the
    # tower has none): Qwen3-VL's timestamps, Qwen2/2.5-VL's second_per_grid_ts
    assert prepared.timestamps and len(prepared.timestamps) == -(-n // 2)
    assert out.column(STAMPS).to_pylist() == [np.float32(prepared.timestamps).tolist(), None, None]
    assert out.column(PER_GRID).to_pylist() == [None, None, None]
    qwen2 = VideoPreprocessConfig.defaults("qwen2")
    out = decode_batch(table, image_column="clip", pp=PP, path_root=None, video_cfg=qwen2)
    per_grid = load_video(good, qwen2).second_per_grid_ts
    assert per_grid is not None and out.column(PER_GRID).to_pylist() == [float(np.float32(per_grid)), None, None]
    assert out.column(STAMPS).to_pylist() == [None, None, None]
    with pytest.raises(InvalidArgumentError, match="timestamps"):  # a video job's output columns are taken
        decode_batch(table.append_column("timestamps", pa.array([1.0] * 3)), image_column="clip", pp=PP,
                     path_root=None, video_cfg=VCFG)  # fmt: skip
    # an image job writes no such column: an input column of that name is kept as it is
    from deployments.batch.decode import check_input_schema

    check_input_schema(pa.schema([("image", pa.binary()), ("timestamps", pa.float64())]), "image")


def test_batch_video_token_jobs_write_and_record_the_fact_columns(tmp_path):
    import pyarrow as pa

    from deployments.batch.columns import output_schema
    from deployments.batch.files import JobError
    from deployments.batch.job import job_params
    from deployments.batch.manifest import Manifest
    from deployments.batch.options import JobConfig

    # the columns follow the grid in every per-token output of a video job, in the LLM answers' names
    base = pa.schema([("id", pa.int64()), ("clip", pa.binary())])
    for kwargs in ({}, {"layout": "vllm"}, {"ec_cache": True}, {"deepstack_layers": 2}):
        names = output_schema(base, "clip", "none", 8, video=True, **kwargs).names
        assert names[names.index("grid_thw") + 1 : names.index("grid_thw") + 3] == ["timestamps", "second_per_grid_ts"]
        assert "timestamps" not in output_schema(base, "clip", "none", 8, **kwargs).names  # an image job's: as it was
    assert output_schema(base, "clip", "mean", 8, video=True) == output_schema(base, "clip", "mean", 8)

    # the manifest records them: a video job begun before they were written is not resumed into parts of two schemas
    job = {"input": ["in"], "output": str(tmp_path), "model": "tiny-qwen3-vl", "video_column": "clip"}
    facts = ["timestamps", "second_per_grid_ts"]
    for kwargs in ({"pooling": "none"}, {"layout": "vllm"}, {"ec_cache_dir": "ec", "uuid_column": "u"}):
        assert job_params(JobConfig(**job, **kwargs), [], 10)["video_columns"] == facts
    assert "video_columns" not in job_params(JobConfig(**job, pooling="mean"), [], 10)
    image_job = {k: v for k, v in job.items() if k != "video_column"}
    assert "video_columns" not in job_params(JobConfig(**image_job, pooling="none"), [], 10)
    params = job_params(JobConfig(**job, pooling="none"), [], 10)
    Manifest.open(tmp_path, {k: v for k, v in params.items() if k != "video_columns"}).write()
    with pytest.raises(JobError, match=r"different parameters \(video_columns\)"):
        Manifest.open(tmp_path, params)


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
