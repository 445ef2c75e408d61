"""vLLM's forms of the LLM outputs (`deployments.vllm_handoff`, issue 47 item 2): the layout `"vllm"` against the
per-part outputs of the tiny Qwen towers (Qwen3-VL with DeepStack, Qwen2.5-VL without), the disk connector's
file as `safetensors` opens it, the uuid checks, and the ingress's handle and HTTP adapters over a fake encoder
client that answers with real encoder outputs (no Ray). The service end to end: test_llm_outputs_serve.py."""

from __future__ import annotations

import asyncio
import base64
import os

import numpy as np
import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from starlette.requests import Request

import encoder
from deployments.config import AppArgs
from deployments.errors import ErrorCode, RequestError
from deployments.ingress.handle_calls import HandleCalls
from deployments.ingress.http_routes import HttpRoutes
from deployments.ingress.limits import Admission
from deployments.ingress.openai_api import parse_embedding_request
from deployments.ingress.security import ApiKeyAuth
from deployments.llm_outputs import from_wire, to_wire, wire_outputs
from deployments.metrics import IngressTelemetry
from deployments.vllm_handoff import (
    EC_CACHE_FILE,
    EC_CACHE_KEY,
    check_uuid,
    check_uuids,
    ec_cache_path,
    vllm_wire,
    write_ec_cache,
)  # fmt: skip
from tests.images_util import random_array

MODELS = {"tiny-qwen3-vl": 2, "tiny": 0}  # preset: DeepStack layers (Qwen3-VL tiny: 2; Qwen2.5-VL tiny: none)
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def outputs():
    """Per preset: its encoder and the `LLMOutput`s of three images of different sizes."""
    images = [random_array(56, 84, 3, seed=1), random_array(112, 56, 3, seed=2), random_array(28, 28, 3, seed=3)]
    got = {}
    for model in MODELS:
        enc = encoder.load(model)
        got[model] = (enc, enc.encode_llm(images))
    return got


# ------------------------------------------------------------------------------------------ the layout


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_vllm_layout_is_the_tokens_then_each_deepstack_layer_on_the_last_axis(outputs, model, dtype):
    enc, outs = outputs[model]
    layers, out_dim = MODELS[model], enc.out_dim
    assert all(len(o.deepstack) == layers for o in outs)
    for o, w in zip(outs, wire_outputs(outs, dtype), strict=True):
        n = o.tokens.shape[0]
        assert n == o.grid_thw[0] * o.grid_thw[1] * o.grid_thw[2] // enc.config.spatial_merge_size**2
        tensor, deepstack, grid = vllm_wire(w)
        assert deepstack == [] and grid == tuple(o.grid_thw)
        assert tensor.shape == (n, out_dim * (1 + layers)) and tensor.dtype == w[0].dtype
        # column block k is part k (tokens, then DeepStack layers in model order), bit for bit
        parts = [w[0], *w[1]]
        for k, part in enumerate(parts):
            np.testing.assert_array_equal(tensor[:, k * out_dim : (k + 1) * out_dim], part)
        # and the same as the encoder's own tensor cast to the dtype (torch's rounding)
        want = o.vllm_embeds().to(TORCH[dtype])
        assert want.shape == tensor.shape
        got = torch.from_numpy(tensor.view(np.int16) if dtype != "float32" else tensor)
        if dtype != "float32":
            got = got.view(TORCH[dtype])
        assert torch.equal(got, want)
        # vLLM's own split of a Qwen3-VL row: [visual_dim, visual_dim * L] (Qwen3VLForConditionalGeneration
        # ._compute_deepstack_embeds), the second part read as L consecutive visual_dim blocks
        main, multiscale = torch.split(want, [out_dim, out_dim * layers], dim=-1)
        assert torch.equal(main, o.tokens.to(TORCH[dtype]))
        for k in range(layers):
            assert torch.equal(multiscale.view(n, layers, out_dim)[:, k], o.deepstack[k].to(TORCH[dtype]))


# ------------------------------------------------------------------------------------------ the disk connector


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_ec_cache_file_opens_with_safetensors_at_the_path_vllm_reads(outputs, model, dtype, tmp_path):
    enc, outs = outputs[model]
    for i, w in enumerate(wire_outputs(outs, dtype)):
        tensor = vllm_wire(w)[0]
        uuid = f"img-{i}:{model}"
        path = write_ec_cache(str(tmp_path), uuid, tensor, dtype)
        # ECExampleConnector: os.path.join(shared_storage_path, mm_hash, "encoder_cache.safetensors")
        assert path == os.path.join(str(tmp_path), uuid, "encoder_cache.safetensors") == ec_cache_path(tmp_path, uuid)
        loaded = load_file(path)  # what the connector calls (safetensors.torch.load_file(...)["ec_cache"])
        assert list(loaded) == [EC_CACHE_KEY]
        got = loaded["ec_cache"]
        width = enc.out_dim * (1 + MODELS[model])
        assert got.dtype == TORCH[dtype] and tuple(got.shape) == (outs[i].tokens.shape[0], width)
        assert torch.equal(got, outs[i].vllm_embeds().to(TORCH[dtype]))
        assert oct(os.stat(path).st_mode & 0o777) == "0o644"
        assert sorted(os.listdir(os.path.dirname(path))) == [EC_CACHE_FILE]  # no temporary file left
    if dtype == "float32":  # numpy reads it too (no torch needed on the reading side)
        with safe_open(path, "np") as f:
            np.testing.assert_array_equal(f.get_tensor(EC_CACHE_KEY), tensor)


def test_ec_cache_write_replaces_an_older_file_and_leaves_nothing_when_it_fails(tmp_path):
    a = to_wire(np.arange(12, dtype=np.float32).reshape(3, 4), "bfloat16")
    path = write_ec_cache(str(tmp_path), "x", a, "bfloat16")
    write_ec_cache(str(tmp_path), "x", a[:2], "bfloat16")
    assert load_file(path)["ec_cache"].shape == (2, 4)
    with pytest.raises(ValueError, match="held as"):  # float32 values named bfloat16: refused before any file
        write_ec_cache(str(tmp_path), "y", np.zeros((2, 2), np.float32), "bfloat16")
    assert not os.path.exists(tmp_path / "y" / EC_CACHE_FILE)
    assert from_wire(load_file(path)["ec_cache"].view(torch.int16).numpy().view(np.uint16)).shape == (2, 4)


@pytest.mark.parametrize(
    "uuid", ["", ".", "..", "../x", "a/b", "/abs", ".hidden", "a\x00b", "a b", "é", "x" * 256, "a\\b", 5, None]
)
def test_a_uuid_that_is_no_safe_directory_name_is_a_400(uuid, tmp_path):
    with pytest.raises(RequestError) as refused:
        check_uuid(uuid)
    assert refused.value.error is ErrorCode.INVALID_UUID and refused.value.param == "ec_cache_uuids"
    with pytest.raises(RequestError):
        write_ec_cache(str(tmp_path), uuid, np.zeros((1, 2), np.float32), "float32")
    assert os.listdir(tmp_path) == []


def test_uuids_are_one_per_image_and_distinct_and_links_cannot_lead_out(tmp_path):
    ok = ["0123abcd" * 8, "sha256:ab", "img_1.v2", "-x", "x" * 255]
    assert check_uuids(ok, 5) == ok
    for bad, match in ((["a"], "1 uuids for 2 images"), (["a", "a"], "given twice"), ("ab", "a list")):
        with pytest.raises(RequestError, match=match):
            check_uuids(bad, 2)
    with pytest.raises(RequestError, match=r"ec_cache_uuids\[1\]: uuid '\.\./etc'"):
        check_uuids(["a", "../etc"], 2)
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "cache"
    root.mkdir()
    os.symlink(outside, root / "escape")
    with pytest.raises(RequestError, match="outside the cache directory"):
        write_ec_cache(str(root), "escape", np.zeros((1, 2), np.float32), "float32")
    assert os.listdir(outside) == []


# ------------------------------------------------------------------------------------------ the ingress


class RealOutputsClient:
    """The encoder client, answering with a real tiny encoder's outputs in the asked wire dtype."""

    def __init__(self, enc, family: str):
        self.enc, self.family, self.calls = enc, family, []

    async def info(self) -> dict:
        dims = {"mean": self.enc.out_dim, "none": self.enc.out_dim}
        return {"vector_pooling": "mean", "output_dims": dims, "preprocess_config": None, "family": self.family,
                "dtype": "bfloat16"}  # fmt: skip

    async def encode(self, arrays, pooling, llm, deadline):
        self.calls.append((len(arrays), pooling, llm))
        if llm is None:
            return [self.enc.encode([a], pooling=pooling)[0].numpy() for a in arrays], 7
        return wire_outputs(self.enc.encode_llm(list(arrays)), llm), 7


class FakeDecoder:
    async def prepare(self, inputs, pp, where, max_patches, reserve):
        return [random_array(56, 84, 3, seed=1) for _ in inputs]


def adapters(outputs, model: str, family: str = "qwen3_vl", **args):
    enc = outputs[model][0]
    client = RealOutputsClient(enc, family)
    a = AppArgs(**args)
    parts = (client, FakeDecoder(), Admission(4))
    http = HttpRoutes(a, *parts, ApiKeyAuth(None), IngressTelemetry(), None, None)
    return HandleCalls(a, *parts, IngressTelemetry()), http, client


def post(r: HttpRoutes, body: dict) -> tuple[int, dict]:
    data = orjson.dumps(body)
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": data, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    request = Request({"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": headers}, receive)
    response = asyncio.run(r.embeddings(request))
    return response.status_code, orjson.loads(response.body)


def test_http_vllm_layout_items_are_the_concatenated_tensor_with_the_grid(outputs):
    _, http, client = adapters(outputs, "tiny-qwen3-vl")
    (want,) = outputs["tiny-qwen3-vl"][0].encode_llm([random_array(56, 84, 3, seed=1)])
    whole = want.vllm_embeds().numpy()
    status, body = post(http, {"input": "a", "embedding_layout": "vllm"})  # pooling none implied
    (item,) = body["data"]
    assert status == 200 and client.calls[-1][1:] == ("none", "float32")
    assert item["shape"] == list(whole.shape) and item["grid_thw"] == list(want.grid_thw) and "deepstack" not in item
    np.testing.assert_allclose(np.array(item["embedding"], np.float32), whole, atol=1e-6)
    body = {"input": "a", "pooling": "none", "embedding_layout": "vllm", "encoding_format": "base64",
            "embedding_dtype": "bfloat16"}  # fmt: skip
    status, answer = post(http, body)
    raw = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), "<u2").reshape(whole.shape)
    np.testing.assert_array_equal(raw, to_wire(whole, "bfloat16"))


@pytest.mark.parametrize(
    "body,family,code",
    [
        ({"input": "a", "embedding_layout": "vllm", "pooling": "mean"}, "qwen3_vl", "invalid_layout"),
        ({"input": "a", "embedding_layout": "vllm"}, "siglip", "invalid_layout"),
        ({"input": [{"text": "t"}, "a"], "embedding_layout": "vllm"}, "qwen3_vl", "invalid_layout"),
        ({"input": "a", "ec_cache_uuids": ["u"], "embedding_layout": "parts"}, "qwen3_vl", "invalid_layout"),
        ({"input": ["a", "b"], "ec_cache_uuids": ["u"]}, "qwen3_vl", "invalid_uuid"),
        ({"input": ["a", "b"], "ec_cache_uuids": ["u", "u"]}, "qwen3_vl", "invalid_uuid"),
        ({"input": "a", "ec_cache_uuids": ["../../etc"]}, "qwen3_vl", "invalid_uuid"),
        ({"input": "a", "ec_cache_uuids": [".ssh"]}, "qwen3_vl", "invalid_uuid"),
    ],
)
def test_http_a_layout_or_uuid_where_it_makes_no_sense_is_a_400(outputs, body, family, code, tmp_path):
    _, http, client = adapters(outputs, "tiny-qwen3-vl", family, ec_cache_dir=str(tmp_path))
    status, answer = post(http, body)
    assert status == 400 and answer["error"]["code"] == code, answer
    param = "ec_cache_uuids" if code == "invalid_uuid" else "embedding_layout"
    assert answer["error"]["param"] == param and client.calls == []
    assert os.listdir(tmp_path) == []


def test_the_schema_takes_the_layouts_and_uuids():
    assert parse_embedding_request(b'{"input": "a", "embedding_layout": "vllm"}').embedding_layout == "vllm"
    assert parse_embedding_request(b'{"input": "a"}').embedding_layout == "parts"
    with pytest.raises(RequestError) as refused:
        parse_embedding_request(b'{"input": "a", "embedding_layout": "flat"}')
    assert refused.value.error is ErrorCode.INVALID_SCHEMA and "embedding_layout" in str(refused.value)
    with pytest.raises(RequestError, match="ec_cache_uuids"):
        parse_embedding_request(b'{"input": "a", "ec_cache_uuids": []}')
    # a 16-bit file needs no base64 answer: the answer holds no tensor
    parsed = parse_embedding_request(b'{"input": "a", "ec_cache_uuids": ["u"], "embedding_dtype": "bfloat16"}')
    assert parsed.ec_cache_uuids == ["u"] and parsed.embedding_dtype == "bfloat16"


def test_http_ec_cache_refused_without_ec_cache_dir(outputs):
    _, http, client = adapters(outputs, "tiny")
    status, answer = post(http, {"input": "a", "ec_cache_uuids": ["u"]})
    assert status == 400 and answer["error"]["code"] == "ec_cache_not_configured" and client.calls == []


@pytest.mark.parametrize("model", list(MODELS))
def test_http_and_handle_write_the_file_vllm_loads(outputs, model, tmp_path):
    handle, http, client = adapters(outputs, model, ec_cache_dir=str(tmp_path))
    (want,) = outputs[model][0].encode_llm([random_array(56, 84, 3, seed=1)])
    whole = want.vllm_embeds()
    # HTTP: the served tower's dtype (bfloat16 here) unless embedding_dtype is given; no path in the answer
    status, body = post(http, {"input": ["a", "b"], "ec_cache_uuids": ["chat-1", "chat-2"]})
    assert status == 200, body
    assert [(d["object"], d["index"], d["uuid"], d["dtype"]) for d in body["data"]] == [
        ("ec_cache", 0, "chat-1", "bfloat16"), ("ec_cache", 1, "chat-2", "bfloat16")]  # fmt: skip
    assert body["data"][0]["shape"] == list(whole.shape) and body["data"][0]["grid_thw"] == list(want.grid_thw)
    assert "path" not in body["data"][0] and client.calls[-1][1:] == ("none", "bfloat16")
    for uuid in ("chat-1", "chat-2"):
        got = load_file(tmp_path / uuid / EC_CACHE_FILE)["ec_cache"]  # a batch of two: float32 noise, then rounding
        assert got.dtype == torch.bfloat16 and got.shape == whole.shape
        torch.testing.assert_close(got.float(), whole, rtol=2**-7, atol=1e-5)
    status, body = post(http, {"input": "a", "ec_cache_uuids": ["f32"], "embedding_dtype": "float32"})
    assert status == 200 and body["data"][0]["dtype"] == "float32"
    assert torch.equal(load_file(tmp_path / "f32" / EC_CACHE_FILE)["ec_cache"], whole)
    # handle: the same file, its path named
    (item,) = asyncio.run(handle.ec_cache([b"img"], ["h-1"], None))
    assert item["path"] == str(tmp_path / "h-1" / EC_CACHE_FILE) and item["dtype"] == "bfloat16"
    assert torch.equal(load_file(item["path"])["ec_cache"], whole.to(torch.bfloat16))
    (item,) = asyncio.run(handle.ec_cache(b"img", "h-2", "float16"))  # one image, one uuid
    assert load_file(item["path"])["ec_cache"].dtype == torch.float16
    # handle: the vLLM layout in memory; refusals are the ingress's RequestError
    (wire,) = asyncio.run(handle([b"img"], "none", "float32", "vllm"))
    np.testing.assert_allclose(wire[0], whole.numpy(), atol=1e-6)
    for call, code in (
        (lambda: handle.ec_cache([b"a"], ["../x"], None), ErrorCode.INVALID_UUID),
        (lambda: handle([b"a"], "mean", None, "vllm"), ErrorCode.INVALID_LAYOUT),
        (lambda: handle([b"a"], "none", "float32", "flat"), ErrorCode.INVALID_LAYOUT),
    ):
        with pytest.raises(RequestError) as refused:
            asyncio.run(call())
        assert refused.value.error is code
    assert sorted(os.listdir(tmp_path)) == ["chat-1", "chat-2", "f32", "h-1", "h-2"]
