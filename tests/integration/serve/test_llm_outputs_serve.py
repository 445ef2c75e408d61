"""LLM-ready outputs through the service (issue 14): the handle's `embed_llm`, HTTP `pooling: "none"` items
with `grid_thw` / `shape` / `deepstack`, and `embedding_dtype` (base64 float16 / bfloat16).

One Serve start-up for the module: the `tiny` preset (no DeepStack) and, when the preset exists, the DeepStack
`tiny-qwen3-vl` side by side (`running_apps`). Outputs are compared with `VisionEncoder.encode_llm` on the same
images (same preset and seed: same random weights). The unit tests at the top need no Ray.
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest
import torch

import encoder
from deployments.errors import RequestError
from deployments.ingress.openai_api import embeddings_body, parse_embedding_request
from deployments.llm_outputs import from_wire, to_wire
from encoder.errors import EncoderError
from encoder.loading.presets import PRESETS
from tests.images_util import encode, random_array, random_image

ATOL = 1e-4
DEEPSTACK_MODEL = "tiny-qwen3-vl"
HAS_DEEPSTACK = DEEPSTACK_MODEL in PRESETS
# rounding of one float32 value to the 16-bit types: half a unit in the last place, relative (float16 also
# flushes below its smallest normal, 2**-14, in steps of 2**-24)
ROUNDING = {"float32": (0.0, 0.0), "float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 0.0)}


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def png(h: int, w: int, seed: int = 0) -> bytes:
    return encode(random_image("RGB", h, w, seed), "PNG")


def decode_b64(text: str, dtype: str, shape) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(text), dtype={"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}[dtype])
    return from_wire(raw).reshape(shape)


def assert_rounded(got: np.ndarray, want: np.ndarray, dtype: str, atol: float = ATOL) -> None:
    """`got` (decoded from `dtype`) is `want` (float32) to within that dtype's rounding (+ `atol`)."""
    rel, tiny = ROUNDING[dtype]
    assert got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = rel * np.abs(want.astype(np.float64)) * (1 + 1e-6) + tiny + atol
    assert (err <= bound).all(), float((err - bound).max())


# ------------------------------------------------------------------------------------------ units (no Ray)


def test_to_wire_rounds_to_nearest_even_like_torch():
    bits = np.array(
        [0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x00000001, 0x80000000,
         0x7F800000, 0xFF800000, 0x7FC00000, 0x477FF000, 0x33000001],
        dtype=np.uint32,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [bits.view(np.float32), rng.standard_normal(4096, dtype=np.float32) * 10.0 ** rng.integers(-8, 8, 4096)]
    )
    x = x.astype(np.float32)
    bf16 = to_wire(x, "bfloat16")
    assert bf16.dtype == np.uint16 and bf16.flags.c_contiguous
    np.testing.assert_array_equal(
        bf16, torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    )
    # the rule itself, on the finite values: the top 16 bits after adding 0x7FFF + the lowest kept bit
    u = x.view(np.uint32)
    finite = np.isfinite(x)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(bf16[finite], rne[finite])
    assert np.isnan(from_wire(bf16)[~np.isfinite(x) & np.isnan(x)]).all()
    assert [hex(v) for v in bf16[:5]] == ["0x3f80", "0x3f80", "0x3f82", "0x3f81", "0x3f80"]  # ties to even
    f16 = to_wire(x, "float16")
    np.testing.assert_array_equal(
        f16.view(np.uint16), torch.from_numpy(x).half().view(torch.int16).numpy().view(np.uint16)
    )
    assert to_wire(x, "float32") is x  # float32 stays as it is, no copy
    assert to_wire(bf16, "bfloat16") is bf16  # already in the wire dtype


def test_to_wire_of_a_tensor_tags_each_16_bit_type_and_reads_non_contiguous_ones():
    """The replica's path (torch tensors): float16 as `np.float16`, bfloat16 as `np.uint16` bit patterns (a swapped tag
    reinterprets the bits as the other type), the same bits as the numpy path; a transposed tensor is read in its
    logical order, not its storage order."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 5), dtype=np.float32)
    for dtype, tag in (("float16", np.float16), ("bfloat16", np.uint16)):
        t = torch.from_numpy(x).to({"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype])
        for tensor, want in ((t, x), (t.t(), x.T)):  # already in the wire dtype: a view, or a copy when transposed
            got = to_wire(tensor, dtype)
            assert got.dtype == tag and got.flags.c_contiguous and got.shape == want.shape
            np.testing.assert_array_equal(
                got.view(np.uint16), to_wire(np.ascontiguousarray(want), dtype).view(np.uint16)
            )
        np.testing.assert_array_equal(
            to_wire(torch.from_numpy(x), dtype).view(np.uint16), to_wire(x, dtype).view(np.uint16)
        )


def test_base64_body_is_the_json_of_its_parts():
    """The base64 answer is assembled around the base64 bytes; it must be the JSON orjson would write."""
    rng = np.random.default_rng(1)
    tokens = [rng.standard_normal((n, 8), dtype=np.float32) for n in (3, 5)]
    deep = [[rng.standard_normal((3, 8), dtype=np.float32) for _ in range(2)], []]
    outputs = [(tokens[0], deep[0], (1, 6, 2)), (tokens[1], deep[1], (1, 2, 10)), tokens[0][0]]
    for dtype in ("float32", "float16", "bfloat16"):
        body = orjson.loads(embeddings_body(outputs, "base64", "m", 42, dtype))
        assert body["model"] == "m" and body["usage"] == {"prompt_tokens": 42, "total_tokens": 42}
        first, second, vector = body["data"]
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert first["shape"] == [3, 8] and first["grid_thw"] == [1, 6, 2] and len(first["deepstack"]) == 2
        assert "deepstack" not in second and second["grid_thw"] == [1, 2, 10]
        assert "shape" not in vector and "grid_thw" not in vector
        for item, (t, ds, _) in ((first, outputs[0]), (second, outputs[1])):
            assert_rounded(decode_b64(item["embedding"], dtype, item["shape"]), t, dtype, 0)
            for text, d in zip(item.get("deepstack", []), ds, strict=True):
                assert_rounded(decode_b64(text, dtype, item["shape"]), d, dtype, 0)
        assert_rounded(decode_b64(vector["embedding"], dtype, (8,)), tokens[0][0], dtype, 0)
    body = orjson.loads(embeddings_body(outputs, "float", "m", 42))
    np.testing.assert_array_equal(np.array(body["data"][0]["deepstack"][1], np.float32), deep[0][1])
    assert body["data"][0]["grid_thw"] == [1, 6, 2]


def test_replica_wire_outputs_and_handle_items_keep_the_asked_dtype_for_every_array():
    """`embed_llm(dtype=...)`: tokens and every DeepStack layer in the wire dtype (np.float16, or np.uint16 bit
    patterns for bfloat16), the grid as a list of ints; no array is left in (or cast back to) float32."""
    from types import SimpleNamespace

    from deployments.llm_outputs import handle_item, wire_outputs

    x = torch.linspace(-3, 3, 8).reshape(2, 4)
    out = SimpleNamespace(tokens=x, deepstack=[x * 2, x * 3], grid_thw=torch.tensor([1, 4, 2]))
    for dtype, tag in (("float32", np.float32), ("float16", np.float16), ("bfloat16", np.uint16)):
        (item,) = [handle_item(w) for w in wire_outputs([out], dtype)]
        assert set(item) == {"tokens", "deepstack", "grid_thw"} and item["grid_thw"] == [1, 4, 2]
        arrays = [item["tokens"], *item["deepstack"]]
        assert [a.dtype for a in arrays] == [np.dtype(tag)] * 3 and len(item["deepstack"]) == 2, dtype
        for a, want in zip(arrays, (x, x * 2, x * 3), strict=True):
            assert_rounded(from_wire(a), want.numpy(), dtype, 0)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"embedding_dtype": "float16"}, "encoding_format='base64'"),
        ({"embedding_dtype": "bfloat16", "encoding_format": "float"}, "encoding_format='base64'"),
        ({"embedding_dtype": "int8", "encoding_format": "base64"}, "float32, float16, bfloat16"),
        ({"embedding_dtype": 16, "encoding_format": "base64"}, "float32, float16, bfloat16"),
    ],
)
def test_bad_embedding_dtype_is_a_400_naming_the_field(body, message):
    with pytest.raises(RequestError) as info:
        parse_embedding_request(orjson.dumps({"input": "x", **body}))
    e = info.value
    assert (e.status, e.code, e.param) == (400, "invalid_embedding_dtype", "embedding_dtype")
    assert "embedding_dtype" in str(e) and message in str(e)
    ok = parse_embedding_request(b'{"input": "x", "embedding_dtype": "bfloat16", "encoding_format": "base64"}')
    assert ok.embedding_dtype == "bfloat16"
    assert parse_embedding_request(b'{"input": "x"}').embedding_dtype == "float32"


def test_a_bad_embedding_dtype_beside_other_schema_errors_is_a_422_naming_them_all():
    with pytest.raises(RequestError) as info:
        parse_embedding_request(b'{"input": "x", "embedding_dtype": "int8", "pooling": "max"}')
    e = info.value
    assert (e.status, e.code) == (422, "invalid_schema") and "embedding_dtype" in str(e) and "pooling" in str(e)


# ------------------------------------------------------------------------------------------ the service


@pytest.fixture(scope="module")
def ec_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ec_cache")


@pytest.fixture(scope="module")
def apps(ray_cluster, ec_cache_dir):
    from deployments import build_app
    from tests.serve_fixtures import running_apps

    base = {"num_replicas": 1, "batcher": "continuous", "pipeline_depth": 2, "max_request_images": 8,
            "ec_cache_dir": str(ec_cache_dir)}  # fmt: skip
    specs = [(build_app({**base, "model": "tiny"}), "llm-tiny", "/")]
    if HAS_DEEPSTACK:
        specs.append((build_app({**base, "model": DEEPSTACK_MODEL}), "llm-deepstack", "/deepstack"))
    with running_apps(specs) as services:
        yield dict(zip(["tiny", DEEPSTACK_MODEL], services, strict=False))


@pytest.fixture(scope="module")
def references():
    return {m: encoder.load(m) for m in ("tiny", DEEPSTACK_MODEL) if m in PRESETS}


MODELS = ["tiny", pytest.param(DEEPSTACK_MODEL, marks=pytest.mark.skipif(not HAS_DEEPSTACK, reason="no preset yet"))]


def post(app, body: dict) -> dict:
    with httpx.Client(base_url=app.base_url, timeout=120) as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_handle_embed_llm_equals_encode_llm(apps, references, model):
    app, ref = apps[model], references[model]
    images = [random_array(90, 60, 3, seed=1), png(64, 100, 2), random_image("RGB", 56, 56, seed=3)]
    want = ref.encode_llm(images)
    got = app.handle.embed_llm.remote(images).result(timeout_s=120)
    assert len(got) == 3
    layers = len(want[0].deepstack)
    assert (layers > 0) == (model != "tiny")
    for g, w in zip(got, want, strict=True):
        assert set(g) == {"tokens", "deepstack", "grid_thw"}
        assert g["grid_thw"] == list(w.grid_thw) and g["tokens"].dtype == np.float32
        np.testing.assert_allclose(g["tokens"], w.tokens.numpy(), atol=ATOL)
        assert len(g["deepstack"]) == layers
        for gd, wd in zip(g["deepstack"], w.deepstack, strict=True):
            np.testing.assert_allclose(gd, wd.numpy(), atol=ATOL)
    # the 16-bit wire dtypes, and one image given alone
    for dtype in ("float16", "bfloat16"):
        (g,) = app.handle.embed_llm.remote(images[0], dtype=dtype).result(timeout_s=120)
        assert g["tokens"].dtype == (np.float16 if dtype == "float16" else np.uint16)
        assert_rounded(from_wire(g["tokens"]), want[0].tokens.numpy(), dtype)
        for gd, wd in zip(g["deepstack"], want[0].deepstack, strict=True):
            assert_rounded(from_wire(gd), wd.numpy(), dtype)
    assert app.handle.embed_llm.remote([]).result(timeout_s=60) == []
    with pytest.raises(EncoderError, match="dtype"):
        app.handle.embed_llm.remote(images, dtype="int8").result(timeout_s=60)
    # None is the default (it failed with "too many values to unpack"); a numpy dtype is named, not repr'd
    (g,) = app.handle.embed_llm.remote(images[:1], dtype=None).result(timeout_s=120)
    assert g["tokens"].dtype == np.float32 and g["grid_thw"] == list(want[0].grid_thw)
    np.testing.assert_allclose(g["tokens"], want[0].tokens.numpy(), atol=ATOL)
    for bad, named in ((np.float16, "of type type (<class 'numpy.float16'>)"), (object(), "of type object;")):
        with pytest.raises(EncoderError, match="unknown dtype") as refusal:
            app.handle.embed_llm.remote(images, dtype=bad).result(timeout_s=60)
        message = str(getattr(refusal.value, "cause", refusal.value))  # not Ray's traceback around it
        assert named in message and " at 0x" not in message, message


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_http_pooling_none_items_carry_grid_shape_and_deepstack(apps, references, model):
    app, ref = apps[model], references[model]
    images = [png(70, 90, 4), png(56, 112, 5)]
    want = ref.encode_llm(images)
    inputs = [data_url(x) for x in images]
    plain = post(app, {"input": inputs, "pooling": "none"})
    b64 = post(app, {"input": inputs, "pooling": "none", "encoding_format": "base64"})
    for fmt, body in (("float", plain), ("base64", b64)):
        for item, w in zip(body["data"], want, strict=True):
            assert item["shape"] == list(w.tokens.shape) and item["grid_thw"] == list(w.grid_thw)
            if fmt == "float":
                tokens = np.array(item["embedding"], np.float32)
                deep = [np.array(d, np.float32) for d in item.get("deepstack", [])]
            else:
                tokens = decode_b64(item["embedding"], "float32", item["shape"])
                deep = [decode_b64(d, "float32", item["shape"]) for d in item.get("deepstack", [])]
            np.testing.assert_allclose(tokens, w.tokens.numpy(), atol=ATOL)
            if w.deepstack:
                assert len(deep) == len(w.deepstack)
                for d, wd in zip(deep, w.deepstack, strict=True):
                    np.testing.assert_allclose(d, wd.numpy(), atol=ATOL)
            else:
                assert "deepstack" not in item  # towers without DeepStack: no key
    mean = post(app, {"input": inputs})["data"][0]
    assert "grid_thw" not in mean and "deepstack" not in mean and "shape" not in mean


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_http_base64_16_bit_answers_are_the_float32_answer_rounded(apps, model):
    app = apps[model]
    inputs = [data_url(png(84, 84, 6))]
    f32 = post(app, {"input": inputs, "pooling": "none", "encoding_format": "base64"})["data"][0]
    shape = f32["shape"]
    tokens = decode_b64(f32["embedding"], "float32", shape)
    deep = [decode_b64(d, "float32", shape) for d in f32.get("deepstack", [])]
    for dtype in ("float16", "bfloat16"):
        body = {"input": inputs, "pooling": "none", "encoding_format": "base64", "embedding_dtype": dtype}
        item = post(app, body)["data"][0]
        assert item["shape"] == shape and item["grid_thw"] == f32["grid_thw"]
        assert len(base64.b64decode(item["embedding"])) == 2 * tokens.size
        assert_rounded(decode_b64(item["embedding"], dtype, shape), tokens, dtype, 1e-6)
        assert len(item.get("deepstack", [])) == len(deep)
        for text, d in zip(item.get("deepstack", []), deep, strict=True):
            assert_rounded(decode_b64(text, dtype, shape), d, dtype, 1e-6)
        # pooled vectors take the 16-bit types too
        vec32 = post(app, {"input": inputs, "encoding_format": "base64"})["data"][0]["embedding"]
        vec = post(app, {"input": inputs, "encoding_format": "base64", "embedding_dtype": dtype})["data"][0]
        dim = len(base64.b64decode(vec32)) // 4
        assert_rounded(decode_b64(vec["embedding"], dtype, (dim,)), decode_b64(vec32, "float32", (dim,)), dtype, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,message",
    [
        ({"embedding_dtype": "float16"}, "encoding_format='base64'"),
        ({"embedding_dtype": "float64", "encoding_format": "base64"}, "one of"),
        ({"embedding_dtype": None, "encoding_format": "base64"}, "one of"),
    ],
)
def test_http_bad_embedding_dtype_is_a_400_naming_the_field(apps, extra, message):
    with httpx.Client(base_url=apps["tiny"].base_url, timeout=60) as c:
        r = c.post("/v1/embeddings", json={"input": [data_url(png(28, 28))], "pooling": "none", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "embedding_dtype" and error["code"] == "invalid_embedding_dtype", error
    assert "embedding_dtype" in error["message"] and message in error["message"]


@pytest.mark.slow
def test_concurrent_mixed_calls_are_merged_and_each_gets_its_own_kind(apps, references):
    """Pooled, float32 LLM and bfloat16 LLM calls queue together at the ingress and in the replica: each is
    grouped with its own kind and answered in order."""
    app, ref = apps["tiny"], references["tiny"]
    images = [random_array(56 + 28 * (i % 3), 84, 3, seed=300 + i) for i in range(18)]
    kinds = ["mean", "float32", "bfloat16"]

    def call(i: int):
        kind = kinds[i % 3]
        if kind == "mean":
            return app.handle.embed.remote([images[i]]).result(timeout_s=180)[0]
        return app.handle.embed_llm.remote([images[i]], dtype=kind).result(timeout_s=180)[0]

    before = app.handle.ingress_stats.remote().result(timeout_s=30)
    with ThreadPoolExecutor(len(images)) as pool:
        out = list(pool.map(call, range(len(images))))
    after = app.handle.ingress_stats.remote().result(timeout_s=30)
    assert after["merged_calls"] - before["merged_calls"] == len(images)
    want = ref.encode_llm(images)
    for i, (got, w) in enumerate(zip(out, want, strict=True)):
        kind = kinds[i % 3]
        if kind == "mean":
            np.testing.assert_allclose(got, w.tokens.mean(0).numpy(), atol=ATOL)
        else:
            assert got["grid_thw"] == list(w.grid_thw) and got["deepstack"] == []
            assert_rounded(from_wire(got["tokens"]), w.tokens.numpy(), kind)


@pytest.mark.slow
def test_replica_encode_llm_pixels_checks_its_inputs(apps, references):
    from ray import serve

    from deployments.config import ENCODER_NAME
    from encoder.errors import InvalidArgumentError, InvalidImageError
    from encoder.preprocessing.images import load_image
    from encoder.preprocessing.qwen import resize_image

    app = apps["tiny"]
    enc = serve.get_deployment_handle(ENCODER_NAME, app_name=app.name)
    pixels = [resize_image(load_image(random_array(60, 60, 3, seed=11)))]
    n = pixels[0].shape[0] // 14 * pixels[0].shape[1] // 14
    ((tokens, deepstack, grid),) = enc.encode_llm_pixels.remote(pixels, num_patches=n).result(timeout_s=60)
    (want,) = references["tiny"].encode_llm(pixels)
    np.testing.assert_allclose(tokens, want.tokens.numpy(), atol=ATOL)
    assert deepstack == [] and grid == want.grid_thw
    with pytest.raises(InvalidArgumentError, match="num_patches"):
        enc.encode_llm_pixels.remote(pixels, num_patches=n + 1).result(timeout_s=60)
    with pytest.raises(InvalidArgumentError, match="num_images=2 but 1 images were sent"):
        enc.encode_llm_pixels.remote(pixels, num_patches=n, num_images=2).result(timeout_s=60)
    with pytest.raises(InvalidArgumentError, match="num_images=3 but 1 images were sent"):
        enc.encode_pixels.remote(pixels, num_images=3).result(timeout_s=60)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        enc.encode_llm_pixels.remote(pixels, dtype="float64").result(timeout_s=60)
    with pytest.raises(InvalidImageError):
        enc.encode_llm_pixels.remote([np.zeros((30, 28, 3), np.uint8)]).result(timeout_s=60)
    assert enc.describe.remote().result(timeout_s=30)["deepstack_layers"] == 0
    if HAS_DEEPSTACK:
        ds = serve.get_deployment_handle(ENCODER_NAME, app_name=apps[DEEPSTACK_MODEL].name)
        layers = len(references[DEEPSTACK_MODEL].config.deepstack_visual_indexes)
        assert ds.describe.remote().result(timeout_s=30)["deepstack_layers"] == layers > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_vllm_layout_and_ec_cache_files_through_the_service(apps, references, ec_cache_dir, model):
    """Issue 47: `embed_llm(layout="vllm")`, HTTP `embedding_layout: "vllm"`, and the files for vLLM's disk
    connector (`write_ec_cache`, `ec_cache_uuids`) equal the concatenation of `encode_llm`'s parts."""
    from safetensors.torch import load_file

    app, ref = apps[model], references[model]
    images = [png(70, 90, 4), png(56, 112, 5)]
    want = [o.vllm_embeds() for o in ref.encode_llm(images)]
    got = app.handle.embed_llm.remote(images, layout="vllm").result(timeout_s=120)
    for g, w, o in zip(got, want, ref.encode_llm(images), strict=True):
        assert set(g) == {"embeds", "grid_thw"} and g["grid_thw"] == list(o.grid_thw)
        np.testing.assert_allclose(g["embeds"], w.numpy(), atol=ATOL)
    body = post(app, {"input": [data_url(x) for x in images], "embedding_layout": "vllm"})
    for item, w in zip(body["data"], want, strict=True):
        assert item["shape"] == list(w.shape) and "deepstack" not in item
        np.testing.assert_allclose(np.array(item["embedding"], np.float32), w.numpy(), atol=ATOL)
    # files: the handle names the path; HTTP does not; both are where vLLM's connector reads mm_hash = uuid
    written = app.handle.write_ec_cache.remote(images, [f"{model}-h0", f"{model}-h1"]).result(timeout_s=120)
    body = post(app, {"input": [data_url(images[0])], "ec_cache_uuids": [f"{model}-http"]})
    assert body["data"][0]["object"] == "ec_cache" and "path" not in body["data"][0]
    for uuid, w in ((f"{model}-h0", want[0]), (f"{model}-h1", want[1]), (f"{model}-http", want[0])):
        tensor = load_file(ec_cache_dir / uuid / "encoder_cache.safetensors")["ec_cache"]
        assert tensor.dtype == torch.float32  # the CPU tower's own dtype
        np.testing.assert_allclose(tensor.numpy(), w.numpy(), atol=ATOL)
    assert written[1]["path"] == str(ec_cache_dir / f"{model}-h1" / "encoder_cache.safetensors")
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        r = c.post("/v1/embeddings", json={"input": [data_url(images[0])], "ec_cache_uuids": ["../x"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_uuid"
    with pytest.raises(RequestError) as refused:
        app.handle.write_ec_cache.remote(images[:1], ["a/b"]).result(timeout_s=60)
    assert refused.value.code == "invalid_uuid"
