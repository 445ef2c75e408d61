"""Service pieces that need no running Serve: arguments, app building, input decoding, error mapping,
the replica's batch prefix, device-side patchify, readiness (the request merger: `test_continuous_batcher.py`).
Fast; the Serve tests cover the same paths end to end."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from deployments.config import AppArgs, replica_plan, resolve_device, resolve_num_gpus
from deployments.errors import ErrorCode, RequestError, classify, with_index
from deployments.ingress.encoder_calls import chunk
from deployments.ingress.inputs import finish_input, open_input, parse_image_string
from deployments.ingress.openai_api import embeddings_body
from deployments.ingress.readiness import encoder_ready
from deployments.preflight import AppConfigError
from deployments.replica.pipeline import best_prefix, check_pixels
from deployments.wire import EncodeRequest
from encoder.errors import (
    ConfigError,
    EncoderError,
    ImageDecodeError,
    ImageTooComplexError,
    ImageTooLargeError,
    InvalidArgumentError,
    InvalidImageError,
)
from encoder.patchify import patchify_many, stack_patchify
from encoder.preprocessing.images import load_image
from encoder.preprocessing.qwen import PreprocessConfig, num_patches, resize_image
from tests.images_util import encode, random_array, random_image
from tests.jpeg_bombs import scan_bomb
from workspace.buckets import BucketKey, default_table

PP = PreprocessConfig()

# ------------------------------------------------------------------------------------------ arguments


def test_app_args_coerce_cli_strings_and_reject_mistakes(tmp_path):
    a = AppArgs.model_validate(
        {"num_replicas": "2", "num_gpus": "0.5", "ingress_batch_size": "0", "buckets": "256,1024"}
    )
    assert (a.num_replicas, a.num_gpus, a.ingress_batch_size) == (2, 0.5, 0)
    assert a.model_name == "tiny" and AppArgs(served_model_name="vit").model_name == "vit"
    assert AppArgs(model=str(tmp_path / "ckpt-7b")).model_name == str(tmp_path / "ckpt-7b")  # not a dir (yet)
    (tmp_path / "ckpt-7b").mkdir()
    assert AppArgs(model=str(tmp_path / "ckpt-7b") + "/").model_name == "ckpt-7b"
    # a Hub id is served without its revision (broken: `model: "org/name"` was 404 for `org/name@v2`)
    assert AppArgs(model="org/name@refs/pr/3").model_name == "org/name"
    bad_args = [{"num_replicas": 0}, {"num_gpus": -1}, {"nmu_replicas": 2}, {"buckets": "256,abc"},
                {"buckets": "pow2:256-1000"}, {"batcher": "magic"},
                {"request_router_class": "ray", "request_router_kwargs": {"x": 1}}]  # fmt: skip
    for bad in bad_args:
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_app_args_groups_take_nested_sections_and_hand_out_one_concern():
    from deployments.app_args import BatchingArgs, ModelArgs

    nested = AppArgs.model_validate({"model": {"model": "tiny", "seed": "3"}, "batching": {"max_batch_size": "8"}})
    flat = AppArgs.model_validate({"model": "tiny", "seed": "3", "max_batch_size": "8"})
    assert nested == flat and (flat.seed, flat.max_batch_size) == (3, 8)
    assert list(AppArgs.model_fields)[:2] == ["model", "served_model_name"]  # the model group first
    assert flat.group(BatchingArgs) == BatchingArgs(max_batch_size=8) and flat.group(ModelArgs).seed == 3
    for bad in ({"batching": {"num_replicas": 2}}, {"batching": {"max_batch_size": 8}, "max_batch_size": 4}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_gpu_and_device_decisions():
    assert resolve_num_gpus(AppArgs(num_gpus=0.25)) == 0.25
    assert resolve_num_gpus(AppArgs(device="cpu")) == 0.0
    assert resolve_num_gpus(AppArgs()) == (1.0 if torch.cuda.is_available() else 0.0)


def test_the_local_gpu_check_reads_device_files_before_torch(monkeypatch, tmp_path):
    """The launcher decides GPU or CPU before Ray starts: from NVIDIA's device files, without importing torch
    (seconds of a cold start on a GPU box); CUDA_VISIBLE_DEVICES hiding every GPU wins; no files: torch decides."""
    import sys

    from deployments import config

    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()  # not a GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(config, "NVIDIA_DEVICE_FILES", str(tmp_path / "nvidia[0-9]*"))
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in the launcher: before Ray starts
    monkeypatch.setitem(sys.modules, "torch", None)  # an import of torch would raise
    assert config.local_gpu_visible() and resolve_num_gpus(AppArgs()) == 1.0
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not config.local_gpu_visible()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    (tmp_path / "nvidia0").unlink()
    monkeypatch.setitem(sys.modules, "torch", torch)  # no device files: torch's answer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert config.local_gpu_visible()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not config.local_gpu_visible()
    assert resolve_device(AppArgs(), 0.5) == "cuda" and resolve_device(AppArgs(), 0) == "cpu"
    assert resolve_device(AppArgs(device="cpu"), 1) == "cpu"


def test_bucket_tables_and_batch_limits():
    tower = SimpleNamespace(
        merge_unit=4, patches_per_image=None, backends={"full": SimpleNamespace(max_graph_tokens=None)}
    )
    vision = SimpleNamespace(model=tower, preprocess_config=PP, num_patches=lambda h, w: num_patches(h, w, PP))

    def plan(device, **args):
        p = replica_plan(AppArgs(**args), vision, device)
        return p.table, (p.max_batch_patches, p.max_batch_images)

    cpu, limits = plan("cpu")
    assert cpu.keys == (BucketKey(256, 1), BucketKey(1024, 1)) and limits == (8192, 32)
    assert plan("cuda")[0] == default_table()  # the engine's default table
    table, limits = plan("cuda", buckets="pow2:256-4096", bucket_max_images=8)
    assert [k.budget for k in table.keys] == [256, 512, 1024, 2048, 4096] and table.largest.max_images == 8
    assert limits == (4096, 8)
    assert plan("cpu", buckets="pow2:256-4096", max_batch_patches=1000, max_batch_size=3)[1] == (1000, 3)
    tower.backends["full"].max_graph_tokens = 8192  # sdpa's cap
    assert plan("cuda", bucket_max_images=4)[0].largest == BucketKey(8192, 4)
    assert plan("cuda")[0].largest.budget == 8192


def test_build_app_from_cli_style_arguments():
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr

    build = import_attr("deployments:build_app")
    app = call_user_app_builder_with_args_if_necessary(build, {"model": "tiny", "num_replicas": "2", "num_gpus": "0.5"})
    ingress = app._bound_deployment
    assert ingress.name == "VisionIngress" and ingress.ray_actor_options["num_cpus"] == 0.25
    enc = ingress.init_args[0]._bound_deployment
    assert enc.name == "VisionEncoder" and enc.num_replicas == 2 and enc.max_ongoing_requests == 512
    assert enc.ray_actor_options == {"num_cpus": 0.5, "num_gpus": 0.5}
    routed = build({"request_router_class": "deployments.routing.router:BucketRouter", "request_router_kwargs": {}})
    config = routed._bound_deployment.init_args[0]._bound_deployment._deployment_config.request_router_config
    assert "BucketRouter" in str(config.request_router_class)
    with pytest.raises(AppConfigError, match="num_replicas"):  # one line, before any replica
        build({"num_replicas": "two"})


def test_default_app_import_path_survives_submodule_imports():
    from ray.serve import Application
    from ray.serve._private.utils import import_attr

    import deployments.application  # noqa: F401 - a submodule import must not shadow `deployments.app`

    assert isinstance(import_attr("deployments:app"), Application)


# ------------------------------------------------------------------------------------------ ingress pieces


def decode_image_string(text: str) -> bytes:
    return parse_image_string(text)[0]


def prepare_image(x, pp):
    return finish_input(open_input(x, pp), pp)


def test_decode_image_strings():
    data = b"\x89PNG fake"
    b64 = base64.b64encode(data).decode()
    assert decode_image_string(f"data:image/png;base64,{b64}") == data
    assert decode_image_string(f"data:;base64,{b64}") == data  # no media type
    assert decode_image_string(b64) == data
    assert decode_image_string(b64[:4] + "\n" + b64[4:]) == data  # MIME line breaks
    cases = {
        "data:image/png;base64": (400, "invalid_data_url"),
        "data:image/png,abc": (400, "invalid_data_url"),
        "data:application/pdf;base64,AAAA": (415, "unsupported_media_type"),
        "http://x/y.png": (400, "invalid_image_url"),
        "abc$": (400, "invalid_base64"),
        "abcde": (400, "invalid_base64"),
    }
    for text, (status, code) in cases.items():
        with pytest.raises(RequestError) as info:
            decode_image_string(text)
        assert (info.value.status, info.value.code) == (status, code), text


def test_prepare_image_sizes_and_unsupported_format():
    arr = prepare_image(encode(random_image("RGB", 50, 70), "PNG"), PP)
    assert arr.dtype == np.uint8 and arr.shape[0] % 28 == 0 and arr.shape[1] % 28 == 0
    same = prepare_image(random_array(50, 70, 3), PP)
    assert same.shape == arr.shape
    with pytest.raises(RequestError) as info:
        prepare_image(encode(random_image("RGB", 16, 16), "ICO"), PP)
    assert info.value.status == 415 and "ICO" in str(info.value)
    with pytest.raises(ImageDecodeError):
        prepare_image(b"not an image", PP)


def test_error_classification():
    class RayTaskErrorLike(ImageTooLargeError):  # what a replica's exception looks like at the ingress
        def __init__(self, cause):
            super().__init__("wrapped")
            self.cause = cause

    def status(exc):
        return classify(exc).error.status

    got = classify(RequestError("x", ErrorCode.UNSUPPORTED_IMAGE_FORMAT, "input"))
    assert (got.error.status, got.error.type, got.error.code, got.param) == (
        415, "invalid_request_error", "unsupported_image_format", "input"
    )  # fmt: skip
    assert status(ImageTooLargeError("x")) == 413
    assert status(RayTaskErrorLike(ImageTooLargeError("big"))) == 413
    got = classify(ImageDecodeError("x")).error
    assert (got.status, got.type, got.code) == (400, "invalid_request_error", "invalid_image")
    assert status(InvalidImageError("x")) == 400
    assert status(InvalidArgumentError("x")) == 400
    assert status(ConfigError("x")) == 500
    assert (classify(RuntimeError("x")).error.status, classify(RuntimeError("x")).error.type) == (500, "server_error")
    e = with_index(ImageDecodeError("bad"), "input[3]")
    assert type(e) is ImageDecodeError and str(e) == "input[3]: bad"
    r = with_index(RequestError("b64", ErrorCode.INVALID_BASE64), "input[1]")
    assert (r.status, r.code, str(r)) == (400, "invalid_base64", "input[1]: b64")


def test_embeddings_body_formats():
    import json

    vec, tokens = np.arange(4, dtype=np.float32), np.arange(6, dtype=np.float32).reshape(3, 2)
    body = json.loads(embeddings_body([vec, tokens], "base64", "tiny", 99))
    assert body["usage"] == {"prompt_tokens": 99, "total_tokens": 99} and body["model"] == "tiny"
    first, second = body["data"]
    assert np.array_equal(np.frombuffer(base64.b64decode(first["embedding"]), "<f4"), vec) and "shape" not in first
    assert second["shape"] == [3, 2]
    assert np.array_equal(np.frombuffer(base64.b64decode(second["embedding"]), "<f4").reshape(3, 2), tokens)
    body = json.loads(embeddings_body([tokens], "float", "tiny", 1))
    assert body["data"][0]["embedding"] == tokens.tolist()


def test_float_answers_are_json_numbers_indexed_in_input_order():
    import json

    vectors = [np.full(3, i + 0.5, np.float32) for i in range(3)]
    for fmt in ("float", "base64"):
        data = json.loads(embeddings_body(vectors, fmt, "tiny", 3))["data"]
        assert [d["index"] for d in data] == [0, 1, 2], fmt
    data = json.loads(embeddings_body(vectors, "float", "tiny", 3))["data"]
    assert [d["embedding"] for d in data] == [[0.5] * 3, [1.5] * 3, [2.5] * 3]  # numbers, not strings
    assert all(type(v) is float for d in data for v in d["embedding"])


def test_chunk_respects_patch_and_image_limits():
    assert chunk([], 10, 2) == []
    assert chunk([4, 4, 4], 8, 10) == [(0, 2), (2, 3)]
    assert chunk([4, 4, 4], 100, 2) == [(0, 2), (2, 3)]
    assert chunk([20, 1], 8, 10) == [(0, 1), (1, 2)]  # an oversize image travels alone


def test_encoder_ready_reads_serve_status():
    def status(state, running):
        dep = SimpleNamespace(status=state, replica_states={"RUNNING": running, "STARTING": 1})
        return SimpleNamespace(applications={"vision": SimpleNamespace(deployments={"VisionEncoder": dep})})

    # ready iff at least one replica runs, whatever the deployment's state (issue 17: the running ones serve)
    assert encoder_ready(status("HEALTHY", 2), "vision")[0] is True
    assert encoder_ready(status("UPDATING", 1), "vision")[0] is True
    assert encoder_ready(status("UPDATING", 0), "vision")[0] is False
    assert encoder_ready(status("UPDATING", 0), "vision")[1]["status"] == "starting"
    assert encoder_ready(status("HEALTHY", 2), "other")[0] is False
    assert encoder_ready(status("UPSCALING", 2), "vision")[0] is True
    assert encoder_ready(status("DOWNSCALING", 1), "vision")[0] is True
    assert encoder_ready(status("UPSCALING", 0), "vision")[0] is False
    assert encoder_ready(status("UNHEALTHY", 2), "vision")[0] is True


# ------------------------------------------------------------------------------------------ replica pieces


def test_check_pixels_validates_and_counts():
    arrays, counts = check_pixels([np.zeros((56, 84, 3), np.uint8), torch.zeros(28, 28, 3, dtype=torch.uint8)], PP)
    assert counts == [24, 4] and all(isinstance(a, np.ndarray) for a in arrays)
    for bad in ([np.zeros((56, 84, 3), np.float32)], [np.zeros((56, 84), np.uint8)], [np.zeros((50, 84, 3), np.uint8)],
                [b"bytes"], np.zeros((1, 28, 28, 3), np.uint8)):  # fmt: skip
        with pytest.raises(EncoderError):
            check_pixels(bad, PP)


def test_stack_patchify_equals_per_image_patchify():
    images = [
        resize_image(load_image(random_array(h, w, 3, seed=i)), PP)
        for i, (h, w) in enumerate([(56, 84), (112, 84), (60, 84), (56, 56), (200, 150), (90, 150)])
    ]
    got = stack_patchify(images, PP, torch.device("cpu"))
    want = patchify_many([torch.from_numpy(x) for x in images], PP)
    assert torch.equal(got.grid_thw, want.grid_thw)
    assert torch.equal(got.pixel_values, want.pixel_values)


def _work(patches: int, images: int = 1, tag: str = "") -> EncodeRequest:
    return EncodeRequest([np.zeros((1, 1, 3), np.uint8)] * images, [patches // images] * images, tag or "mean")


def test_replica_keeps_the_prefix_with_the_best_patches_per_replay_cost():
    def keep(counts):
        return best_prefix([_work(c) for c in counts], default_table(), fixed_cost=512)

    assert keep([256] * 17) == 16  # 4352 patches would replay the 8192 bucket: 16 fill 4096 exactly
    assert keep([256] * 32) == 32  # a full 8192 bucket
    assert keep([256] * 3) == 3  # 768 in the 1024 bucket costs what 512 does per patch: the longer one
    assert keep([256, 256]) == 2
    assert keep([9216, 256]) == 2  # 9472 patches -> 16384 bucket beats 9216 alone in the same bucket
    assert keep([256] * 16 + [9216]) == 16  # a big image that would double the bucket waits for the next batch
    assert keep([300]) == 1


def test_ingress_decodes_only_small_pictures_on_its_event_loop():
    from deployments.ingress.decoding import _INLINE_DECODE_PIXELS, _small
    from deployments.ingress.inputs import source_pixels as _source_pixels

    small_png = encode(random_image("RGB", 224, 224, 1), "PNG")
    flat = encode(Image.new("RGB", (3000, 2000), (9, 9, 9)), "PNG")  # 9 MB of pixels in a few KB
    assert _small(small_png) and _small(flat) and not _small(b"x" * (1 << 20))
    assert _source_pixels(open_input(small_png, PP)) == 224 * 224 <= _INLINE_DECODE_PIXELS
    assert _source_pixels(open_input(flat, PP)) == 3000 * 2000 > _INLINE_DECODE_PIXELS  # decoded in the pool
    assert _source_pixels(open_input(np.zeros((56, 84, 3), np.uint8), PP)) == 56 * 84


def test_bucket_router_is_the_default_and_ray_default_is_selectable():
    from deployments.config import AppArgs

    assert AppArgs().request_router_class == "deployments.routing.router:BucketRouter"
    assert AppArgs(request_router_class="ray").request_router_class is None


def test_ingress_input_opening_refuses_scan_bombs_and_words_pillow_errors():
    """The ingress opens bytes itself: the structural guard runs there too (a progressive scan bomb is
    refused before any decode, as 413), and Pillow's errors reach the client without object reprs."""
    bomb = scan_bomb(2000)
    with pytest.raises(ImageTooComplexError, match="max_jpeg_scans"):
        open_input(bomb, PP)
    assert classify(ImageTooComplexError("x")).error.status == 413
    with pytest.raises(ImageDecodeError) as info:
        open_input(b"\xff\xd8\xff\xe0 not really a jpeg", PP)
    assert "object at 0x" not in str(info.value) and "bytes" in str(info.value)


@pytest.mark.parametrize(
    "bad", [np.zeros(()), np.zeros(5, np.uint8), np.array([None] * 3, dtype=object), np.zeros((8, 8, 3), np.float32)]
)
def test_handle_arrays_that_are_not_images_get_a_clear_error(bad):
    """A 0-d, 1-D, object or float array is an InvalidImageError (400) when opened, not an IndexError later."""
    with pytest.raises(InvalidImageError, match="image arrays must"):
        open_input(bad, PP)
    named = with_index(InvalidImageError("image arrays must be uint8"), "input[2]")
    assert str(named).startswith("input[2]: ") and classify(named).error.status == 400
