"""The ingress's encoder cache (`deployments.ingress.cache`, issue 47 item 3) without Serve: the LRU and its byte
bound, the key (one test per field that changes the answer: a change misses), the bypass option, client keys scoped
by API key, and the cache inside the request lifecycle (`HandleCalls`, `HttpRoutes`) against a fake encoder and
decoder. End to end through the running app: tests/integration/serve/test_cache_serve.py."""

from __future__ import annotations

import asyncio
import base64
import random
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
from starlette.requests import Request

from deployments.config import AppArgs
from deployments.errors import RequestError
from deployments.ingress.cache import (
    ENTRY_OVERHEAD,
    CacheKey,
    EncoderCache,
    Form,
    content_digest,
    freeze,
    handed_out,
    item_key,
    model_fingerprint,
)
from deployments.ingress.handle_calls import HandleCalls
from deployments.ingress.http_routes import HttpRoutes
from deployments.ingress.limits import Admission, check_request_patches
from deployments.ingress.security import ApiKeyAuth
from deployments.llm_outputs import to_wire
from deployments.metrics import IngressTelemetry
from encoder.errors import ImageDecodeError

PATCH = 2


def info(**over) -> dict:
    """A Qwen-like encoder's describe() (vLLM layout allowed) with a text side."""
    return {
        "model": "fake", "model_info": {"name": "fake", "kind": "hub", "revision": "main", "commit": "abc"},
        "family": "qwen2_5_vl", "dtype": "float32", "quantization": None, "out_dim": 4,
        "output_dims": {"mean": 4, "none": 4}, "vector_pooling": "mean", "deepstack_layers": 1,
        "preprocess": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": PATCH},
        "preprocess_config": SimpleNamespace(patch_size=PATCH),
        "text": {"seq_len": 8, "max_batch_texts": 4, "output_dims": {"model": 4, "model-l2": 4}},
    } | over  # fmt: skip


class FakeClient:
    """Outputs that depend on the image (its first pixel), the pooling and the dtype; counts every image and text
    it is sent."""

    def __init__(self, **over):
        self.info_ = info(**over)
        self.images, self.texts = [], []

    async def info(self) -> dict:
        return self.info_

    async def encode(self, arrays, pooling, llm, deadline):
        self.images += [int(a[0, 0, 0]) for a in arrays]
        await asyncio.sleep(0)
        out = []
        for a in arrays:
            v = float(a[0, 0, 0]) + (0.5 if pooling == "none" else 0.0)
            if llm is None:
                out.append(np.full(4, v, np.float32))
            else:
                t = to_wire(np.full((2, 4), v, np.float32) + np.arange(4, dtype=np.float32), llm)
                out.append((t, [to_wire(np.full((2, 4), -v, np.float32), llm)], (1, 4, 2)))
        return out, sum((a.shape[0] // PATCH) * (a.shape[1] // PATCH) for a in arrays)

    async def encode_texts(self, texts, pooling, deadline):
        self.texts += list(texts)
        return [(np.full(4, len(t) + (0.25 if pooling == "model-l2" else 0), np.float32), len(t)) for t in texts]


def pixels(x) -> np.ndarray:
    """What the fake decoder makes of an input: a 4x4 image of its first byte (a `bad` input fails)."""
    if isinstance(x, np.ndarray):
        return x
    data = base64.b64decode(x.partition(",")[2] or x) if isinstance(x, str) else bytes(x)
    if data.startswith(b"bad"):
        raise ImageDecodeError("cannot identify image data")
    return np.full((4, 4, 3), data[0], np.uint8)


class FakeDecoder:
    def __init__(self):
        self.decoded = []

    async def prepare(self, images, pp, label, max_patches, reserve):
        arrays = []
        for i, x in enumerate(images):
            try:
                arrays.append(pixels(x))
            except ImageDecodeError as e:
                where = label(i) if callable(label) else f"{label}[{i}]"
                raise ImageDecodeError(f"{where}: {e}") from None
        total = sum((a.shape[0] // PATCH) * (a.shape[1] // PATCH) for a in arrays)
        if max_patches is not None:
            check_request_patches(total, max_patches)
        if reserve is not None:
            reserve(total)
        self.decoded += list(images)
        return arrays


def handles(cache: EncoderCache | None = None, client: FakeClient | None = None, **args):
    client = client or FakeClient()
    decoder = FakeDecoder()
    telemetry = IngressTelemetry()
    cache = cache if cache is not None else EncoderCache(1 << 20, telemetry)
    h = HandleCalls(AppArgs(**args), client, decoder, Admission(64), telemetry, None, cache)
    return h, client, decoder, cache


def run(coro):
    return asyncio.run(coro)


def key(content: bytes = b"x", model: str = "m", **form) -> CacheKey:
    return CacheKey(model, Form(**({"kind": "image", "pooling": "mean"} | form)), ("sha256", content))


# ------------------------------------------------------------------------------------------ the LRU


def test_least_recently_used_goes_first_and_a_lookup_refreshes():
    each = 16 + ENTRY_OVERHEAD  # a float32 [4] vector and its bookkeeping
    cache = EncoderCache(3 * each)
    for c in (b"a", b"b", b"c"):
        assert cache.put(key(c), np.zeros(4, np.float32), 1)
    assert cache.bytes == 3 * each and cache.keys() == [key(b"a"), key(b"b"), key(b"c")]
    assert list(cache.lookup([key(b"a")], "image")) == [0]  # a is now the most recently used
    cache.put(key(b"d"), np.zeros(4, np.float32), 1)
    assert cache.keys() == [key(b"c"), key(b"a"), key(b"d")] and cache.evictions == 1  # b went
    cache.put(key(b"c"), np.ones(4, np.float32), 1)  # a store refreshes too, and replaces
    assert cache.keys() == [key(b"a"), key(b"d"), key(b"c")] and cache.bytes == 3 * each
    assert cache.lookup([key(b"c")], "image")[0].value[0] == 1.0


def test_the_byte_bound_is_never_exceeded():
    rng = random.Random(0)
    cache = EncoderCache(64 * 1024)
    for i in range(500):
        n = rng.choice([1, 16, 256, 4096, 20000])
        stored = cache.put(key(str(i).encode()), np.zeros(n, np.float32), n)
        assert stored == (4 * n + ENTRY_OVERHEAD <= cache.max_bytes)
        assert cache.bytes <= cache.max_bytes
        assert cache.bytes == sum(cache._entries[k].nbytes for k in cache.keys())
    # an entry larger than the whole bound is not stored and evicts nothing
    before = cache.keys()
    assert not cache.put(key(b"huge"), np.zeros(64 * 1024, np.uint8), 1)
    assert cache.keys() == before


def test_stored_outputs_are_read_only_copies_and_handed_out_writable():
    vec = np.arange(4, dtype=np.float32)
    wire = (np.ones((2, 4), np.float32), [np.zeros((2, 4), np.float32)], (1, 4, 2))
    cache = EncoderCache(1 << 20)
    cache.put(key(b"v"), vec, 1)
    cache.put(key(b"w"), wire, 1)
    vec[:] = -1  # the caller's buffer changes later: the entry does not
    wire[0][:] = -1
    stored = cache.lookup([key(b"v"), key(b"w")], "image")
    v, (tokens, deepstack, grid) = stored[0].value, stored[1].value
    assert v.tolist() == [0, 1, 2, 3] and (tokens == 1).all() and grid == (1, 4, 2)
    with pytest.raises(ValueError):
        v[0] = 5  # nobody writes a stored buffer
    with pytest.raises(ValueError):
        deepstack[0][0, 0] = 5
    out = handed_out(v)
    out[0] = 5
    assert v[0] == 0  # the caller's copy is its own
    t2, d2, g2 = handed_out(stored[1].value)
    assert t2.flags.writeable and isinstance(d2, list) and d2[0].flags.writeable and g2 == (1, 4, 2)
    assert freeze(vec)[1] == 16 and freeze(wire)[1] == 64


# ------------------------------------------------------------------------------------------ the key


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other"),  # the model's name
        ("model_info", {"name": "fake", "kind": "hub", "revision": "v2", "commit": "abc"}),  # its revision
        ("model_info", {"name": "fake", "kind": "hub", "revision": "main", "commit": "def"}),  # its commit
        ("family", "qwen3_vl"),
        ("dtype", "bfloat16"),
        ("quantization", "fp8"),
        ("out_dim", 8),
        ("deepstack_layers", 3),
        ("preprocess", {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": PATCH}),  # a preprocessing setting
        ("text", None),
    ],
)
def test_each_fact_of_the_model_changes_the_key(field, value):
    assert model_fingerprint(info(**{field: value}), AppArgs()) != model_fingerprint(info(), AppArgs())


@pytest.mark.parametrize(
    "arg", [{"model": "tiny-qwen3-vl"}, {"seed": 1}, {"dtype": "bfloat16"}, {"attention": "triton"}, {"device": "cpu"}]
)
def test_each_loading_argument_changes_the_key(arg):
    assert model_fingerprint(info(), AppArgs(**arg)) != model_fingerprint(info(), AppArgs())


def test_the_key_is_the_content_in_any_encoding_and_nothing_else():
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
    b64 = base64.b64encode(png).decode()
    same = {content_digest(png), content_digest(bytearray(png)), content_digest(memoryview(png)),
            content_digest(b64), content_digest(f"data:image/png;base64,{b64}")}  # fmt: skip
    assert len(same) == 1 and None not in same
    assert content_digest(png + b"\0") not in same
    arr = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    assert content_digest(arr) == content_digest(arr.copy()) != content_digest(arr.reshape(4, 12))  # shape counts
    assert content_digest(arr) == content_digest(np.asfortranarray(arr))  # the pixels, not their memory order
    assert content_digest(arr.tobytes()) != content_digest(arr)  # an array is not its bytes as an encoded file
    # no content key: a URL (its content may change), a PIL image, what the decoder will refuse
    for x in ("https://example.com/a.png", "not base64!", "data:text/plain;base64,AAAA", arr.astype(np.float32)):
        assert content_digest(x) is None
    assert item_key("m", Form("image", "mean"), "https://example.com/a.png", None, "open") is None
    assert item_key("m", Form("image", "mean"), "https://example.com/a.png", "u1", "open") is not None


def two_calls(first: dict, second: dict, **client) -> tuple[int, int]:
    """Images the encoder was sent by a first call and a second one of the same image with other arguments."""
    h, c, _, _ = handles(client=FakeClient(**client))
    run(h([b"\x07"], **first))
    n = len(c.images)
    run(h([b"\x07"], **second))
    return n, len(c.images) - n


@pytest.mark.parametrize(
    "first,second",
    [
        ({"pooling": "mean", "llm": None}, {"pooling": "none", "llm": None}),  # pooling
        ({"pooling": "none", "llm": "float32"}, {"pooling": "none", "llm": "bfloat16"}),  # LLM outputs' dtype
        ({"pooling": "none", "llm": None}, {"pooling": "none", "llm": "float32"}),  # vectors vs LLM outputs
        ({"pooling": "none", "llm": "float32"}, {"pooling": "none", "llm": "float32", "layout": "vllm"}),  # layout
    ],
)
def test_a_change_of_output_form_misses(first, second):
    assert two_calls(first, first) == (1, 0)  # the same call again: a hit
    assert two_calls(first, second) == (1, 1)


def test_text_and_image_of_the_same_bytes_are_apart_and_texts_are_cached():
    h, c, _, cache = handles()
    image = base64.b64encode(b"\x05abc").decode()
    run(h.text([image], None))
    run(h([image], None, None))
    assert (len(c.texts), len(c.images)) == (1, 1)
    run(h.text([image, "another"], None))
    assert c.texts == [image, "another"]  # the first text was a hit
    run(h.text([image], "model-l2"))  # a text's pooling is part of its key
    assert len(c.texts) == 3 and len(cache) == 4


def test_another_model_misses_the_same_cache():
    cache = EncoderCache(1 << 20)
    h1, c1, _, _ = handles(cache)
    h2, c2, _, _ = handles(cache, FakeClient(model_info={"name": "fake", "kind": "hub", "commit": "new"}))
    run(h1([b"\x01"], None, None))
    run(h2([b"\x01"], None, None))
    assert (c1.images, c2.images) == ([1], [1]) and len(cache) == 2


# ------------------------------------------------------------------------------------------ in the lifecycle


def test_a_hit_skips_decode_and_encode_and_answers_the_same():
    h, c, d, cache = handles()
    arr = np.full((6, 4, 3), 9, np.uint8)
    first = run(h([b"\x03", arr], None, "float32", "parts"))
    again = run(h([arr, b"\x03"], None, "float32", "parts"))
    assert c.images == [3, 9] and len(d.decoded) == 2  # nothing decoded or encoded the second time
    for a, b in zip(first, again[::-1], strict=True):
        assert a[0].tobytes() == b[0].tobytes() and a[1][0].tobytes() == b[1][0].tobytes() and a[2] == b[2]
        assert a[0].flags.writeable and b[0].flags.writeable  # the handle's arrays are the caller's to keep
    t = h._lifecycle._telemetry.counts
    assert (t["cache_hits"], t["cache_misses"]) == (2, 2) and cache.snapshot()["entries"] == 2


def test_partial_hits_send_only_the_misses_and_errors_name_the_original_position():
    h, c, d, _ = handles()
    run(h([b"\x01", b"\x02"], None, None))
    got = run(h([b"\x02", b"\x04", b"\x01", b"\x06"], None, None))
    assert [v[0] for v in got] == [2.0, 4.0, 1.0, 6.0] and c.images == [1, 2, 4, 6]
    with pytest.raises(ImageDecodeError, match=r"images\[2\]"):
        run(h([b"\x01", b"\x02", b"bad"], None, None))


def test_the_bypass_option_neither_reads_nor_stores():
    h, c, _, cache = handles()
    run(h([b"\x01"], None, None, cache=False))
    assert len(cache) == 0 and h._lifecycle._telemetry.counts["cache_misses"] == 0
    run(h([b"\x01"], None, None))
    run(h([b"\x01"], None, None, cache=False))  # stored now, and still not read
    assert c.images == [1, 1, 1]
    run(h.text(["a"], None, cache=False))
    assert len(cache) == 1
    with pytest.raises(Exception, match="cache must be True or False"):
        run(h([b"\x01"], None, None, cache="no"))


def test_concurrent_identical_requests_compute_independently_and_store_once():
    h, c, _, cache = handles()

    async def both():
        return await asyncio.gather(h([b"\x08"], None, None), h([b"\x08"], None, None))

    a, b = run(both())
    assert c.images == [8, 8] and a[0].tobytes() == b[0].tobytes()
    assert len(cache) == 1 and cache.bytes == 16 + ENTRY_OVERHEAD


def test_handle_cache_uuids_skip_hashing_and_name_the_image():
    h, c, _, _ = handles()
    run(h([b"\x01"], None, None, cache_uuids=["u1"]))
    got = run(h([b"\x02"], None, None, cache_uuids=["u1"]))  # the client's promise: u1 is image 1
    assert got[0][0] == 1.0 and c.images == [1]
    run(h([b"\x01"], None, None))  # the content key is another entry
    assert c.images == [1, 1]
    with pytest.raises(RequestError, match="cache uuid"):
        run(h([b"\x01"], None, None, cache_uuids=[""]))
    with pytest.raises(RequestError, match="one uuid"):
        run(h([b"\x01"], None, None, cache_uuids=["a", "b"]))


def test_write_ec_cache_writes_its_file_on_a_hit(tmp_path):
    h, c, _, _ = handles(ec_cache_dir=str(tmp_path))
    first = run(h.ec_cache([b"\x02"], ["img-1"], "float32"))
    path = tmp_path / "img-1" / "encoder_cache.safetensors"
    data = path.read_bytes()
    path.unlink()
    again = run(h.ec_cache([b"\x02"], ["img-1"], "float32"))
    assert c.images == [2] and path.read_bytes() == data and again == first
    run(h.ec_cache([b"\x02"], ["img-2"], "float32"))  # another uuid, the same image: a hit, its own file
    assert c.images == [2] and (tmp_path / "img-2" / "encoder_cache.safetensors").read_bytes() == data


# ------------------------------------------------------------------------------------------ HTTP


def routes(cache: EncoderCache, key: str | None = None, client: FakeClient | None = None, **args):
    client = client or FakeClient()
    r = HttpRoutes(AppArgs(**args), client, FakeDecoder(), Admission(64), ApiKeyAuth(key), IngressTelemetry(), None,
                   None, cache)  # fmt: skip
    return r, client


def post(r: HttpRoutes, body: dict, key: str | None = None) -> tuple[int, bytes]:
    data, sent = orjson.dumps(body), []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": data, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    request = Request({"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": headers}, receive)
    response = asyncio.run(r.embeddings(request))
    return response.status_code, response.body


def b64(first: int) -> str:
    return base64.b64encode(bytes([first, 1, 2, 3])).decode()


@pytest.mark.parametrize(
    "form",
    [
        {"input": [b64(1), {"text": "hello"}, f"data:image/png;base64,{b64(2)}"]},
        {"input": [b64(1), f"data:image/png;base64,{b64(2)}"], "pooling": "none", "encoding_format": "base64",
         "embedding_dtype": "bfloat16"},
        {"input": [b64(1), b64(2)], "embedding_layout": "vllm", "encoding_format": "base64"},
    ],
)  # fmt: skip
def test_http_answers_are_byte_identical_cached_and_uncached(form):
    cached, c1 = routes(EncoderCache(1 << 20))
    plain, c2 = routes(EncoderCache(1 << 20))
    answers = [post(cached, form) for _ in range(3)]
    uncached = post(plain, form | {"cache": False})
    assert all(a == uncached for a in answers) and uncached[0] == 200  # usage (patches, tokens) included
    assert c1.images == [1, 2] and c1.texts == c2.texts and c2.images == [1, 2]


def test_http_uuids_are_scoped_by_the_api_key():
    cache = EncoderCache(1 << 20)
    alice, c1 = routes(cache, "alice-key")
    bob, c2 = routes(cache, "bob-key")
    assert post(alice, {"input": [{"image": b64(1), "uuid": "photo"}]}, "alice-key")[0] == 200
    # bob's "photo" is another image: it never reads alice's entry
    status, body = post(bob, {"input": [{"image": b64(2), "uuid": "photo"}]}, "bob-key")
    assert status == 200 and orjson.loads(body)["data"][0]["embedding"][0] == 2.0 and c2.images == [2]
    # alice's own uuid is a hit (her promise: the same uuid is the same image), with other bytes sent
    status, body = post(alice, {"input": [{"image": b64(3), "uuid": "photo"}]}, "alice-key")
    assert orjson.loads(body)["data"][0]["embedding"][0] == 1.0 and c1.images == [1]
    # content keys are shared: the same bytes give the same answer whoever sends them
    post(bob, {"input": [b64(9)]}, "bob-key")
    post(alice, {"input": [b64(9)]}, "alice-key")
    assert c2.images == [2, 9] and c1.images == [1]
    assert ApiKeyAuth("alice-key").identity != ApiKeyAuth("bob-key").identity != ApiKeyAuth(None).identity
    assert "alice-key" not in ApiKeyAuth("alice-key").identity


def test_http_uuid_and_cache_fields_are_checked():
    r, _ = routes(EncoderCache(1 << 20))
    status, body = post(r, {"input": [{"image": b64(1), "uuid": ""}]})
    assert status == 400 and orjson.loads(body)["error"]["code"] == "invalid_uuid"
    assert orjson.loads(body)["error"]["param"] == "input[0].uuid"
    assert post(r, {"input": [{"text": "a", "uuid": "x"}]})[0] == 422  # texts are keyed by their string
    assert post(r, {"input": [b64(1)], "cache": "no"})[0] == 422


def test_the_request_patch_limit_counts_the_hits():
    r, c = routes(EncoderCache(1 << 20), max_request_patches=8)
    assert post(r, {"input": [b64(1), b64(2)]})[0] == 200  # 4 patches each
    status, body = post(r, {"input": [b64(1), b64(2), b64(3)]})  # two hits and a miss: 12 > 8
    assert status == 413 and c.images == [1, 2], body
    # every image a hit: the limit still holds (the hits were stored through a route with a larger limit)
    cache = EncoderCache(1 << 20)
    r2, c2 = routes(cache, max_request_patches=8)
    big, _ = routes(cache, client=c2)
    post(big, {"input": [b64(1), b64(2), b64(3)]})
    assert post(r2, {"input": [b64(1), b64(2), b64(3)]})[0] == 413 and c2.images == [1, 2, 3]


# ------------------------------------------------------------------------------------------ videos bypass it


class VideoClient(FakeClient):
    """`FakeClient` that also takes videos (uint8 [n, H, W, 3]: their output is their first pixel + 100)."""

    def __init__(self):
        super().__init__(video_config=SimpleNamespace(patch_size=PATCH, temporal_patch_size=2))

    async def encode(self, arrays, pooling, llm, deadline):
        images = [a for a in arrays if a.ndim == 3]
        out, patches = await super().encode(images, pooling, llm, deadline) if images else ([], 0)
        out = iter(out)
        answer = [next(out) if a.ndim == 3 else np.full(4, 100 + float(a[0, 0, 0, 0]), np.float32) for a in arrays]
        videos = [a for a in arrays if a.ndim == 4]
        return answer, patches + sum(
            -(-a.shape[0] // 2) * (a.shape[1] // PATCH) * (a.shape[2] // PATCH) for a in videos
        )


def test_videos_bypass_the_cache_and_the_images_beside_them_are_cached():
    h, client, decoder, cache = handles(client=VideoClient())
    decoded_videos = []

    async def prepare_videos(videos, vcfg, label):
        decoded_videos.extend(videos)
        return [(np.full((2, 4, 4, 3), v, np.uint8), None, None) for v in videos]  # frames, timestamps, s/grid

    decoder.prepare_videos = prepare_videos
    images = [np.full((4, 4, 3), 1, np.uint8), np.full((4, 4, 3), 2, np.uint8)]
    first = run(h(images, None, None, videos=[7]))
    second = run(h(images, None, None, videos=[7]))
    assert [float(x[0]) for x in first] == [float(x[0]) for x in second] == [1.0, 2.0, 107.0]
    assert client.images == [1, 2]  # the images once: the second call's were hits
    assert decoded_videos == [7, 7]  # the video decoded and encoded both times, never stored
    assert len(cache) == 2
