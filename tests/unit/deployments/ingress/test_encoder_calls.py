"""`EncoderClient`'s transport per encoder call: inline (gRPC in Ray's throughput mode) or by reference (the
object store) for big pixels or big answers. Fake handles record which one each call took; no Ray needed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from deployments.config import AppArgs
from deployments.ingress.encoder_calls import EncoderClient, answer_bytes
from deployments.metrics import IngressTelemetry
from encoder.preprocessing.qwen import PreprocessConfig

PP = PreprocessConfig()  # patch 14, merge 2: a 224x224 image is 256 patches, 64 tokens
DESCRIBE = {
    "out_dim": 3584,
    "output_dims": {"mean": 3584, "none": 3584},
    "deepstack_layers": 0,
    "preprocess": PP.model_dump(mode="json"),
    "max_batch_patches": 65536,
    "max_batch_images": 64,
}


def test_answer_bytes_counts_vectors_token_matrices_and_wire_dtypes():
    info = DESCRIBE | {"preprocess_config": PP}
    counts = [256, 1024]  # 224x224 and 448x448: 64 and 256 tokens
    assert answer_bytes(info, counts, "mean", None) == 2 * 3584 * 4
    assert answer_bytes(info, counts, "none", None) == 320 * 3584 * 4  # float32 token matrices
    assert answer_bytes(info, counts, "none", "bfloat16") == 320 * 3584 * 2
    assert answer_bytes(info, counts, "none", "float32") == 320 * 3584 * 4
    deepstack = info | {"deepstack_layers": 3}
    assert answer_bytes(deepstack, counts, "none", "float16") == 4 * 320 * 3584 * 2  # tokens + 3 layers


class _Response:
    """What a handle call returns: awaitable, cancellable."""

    def __init__(self, value):
        self._value = value

    def __await__(self):
        async def value():
            return self._value

        return value().__await__()

    def cancel(self) -> None:
        pass


SENT_KWARGS: list[dict] = []  # the keyword arguments of every encoder call, as a router would read them


class _Method:
    def __init__(self, calls: list, name: str, by_reference: bool):
        self._calls, self._name, self._by_reference = calls, name, by_reference

    def remote(self, pixels=None, **kwargs):
        if self._name == "describe":
            return _Response(dict(DESCRIBE))
        self._calls.append((self._name, len(pixels), self._by_reference))
        SENT_KWARGS.append(kwargs)
        return _Response([None] * len(pixels))


class _Encoder:
    """A DeploymentHandle stand-in: `options(_by_reference=True)` gives the by-reference handle."""

    app_name = "fake"  # the key of the process's replica progress record (`routing.progress.progress_for`)

    def __init__(self, calls: list, by_reference: bool = False):
        self._calls, self._by_reference = calls, by_reference

    def options(self, _by_reference: bool = False) -> _Encoder:
        return _Encoder(self._calls, _by_reference)

    def __getattr__(self, name: str) -> _Method:
        return _Method(self._calls, name, self._by_reference)


def test_big_answers_and_big_pixels_go_by_reference_small_calls_inline():
    calls: list = []
    telemetry = IngressTelemetry()
    client = EncoderClient(_Encoder(calls), AppArgs(ingress_batch_size=0), telemetry)
    img = np.zeros((224, 224, 3), np.uint8)  # 150 KB of pixels, 256 patches

    async def main():
        await client.encode([img], "mean")  # 14 KB answer
        await client.encode([img] * 3, "mean")
        await client.encode([img], "none", llm="bfloat16")  # 64 x 3584 x 2 = 459 KB answer
        await client.encode([img], "none")  # float32 tokens: 917 KB
        await client.encode([img] * 15, "mean")  # 2.3 MB of pixels

    asyncio.run(main())
    assert calls == [
        ("encode_pixels", 1, False),
        ("encode_pixels", 3, False),
        ("encode_llm_pixels", 1, True),
        ("encode_pixels", 1, True),
        ("encode_pixels", 15, True),
    ]
    rounds = telemetry.snapshot()["timings_ms"]["encoder_call"]
    assert rounds["n"] == 5 and {"inline", "by_reference"} <= rounds.keys()


def test_each_encoder_call_tells_the_router_its_patches_and_images():
    """Broken: calls carried `num_patches` only, so the router took every call for one image; 32 merged
    thumbnails (512 patches) went to the owner of the 512-patch bucket, whose table caps it at 8 images."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    from deployments.routing.assignment import request_size

    SENT_KWARGS.clear()
    client = EncoderClient(_Encoder([]), AppArgs(ingress_batch_size=0), IngressTelemetry())
    small, big = np.zeros((56, 56, 3), np.uint8), np.zeros((224, 448, 3), np.uint8)  # 16 and 512 patches

    async def main():
        await client.encode([small] * 32, "mean")
        await client.encode([big, small, small], "none", llm="float16")
        await client.encode([small] * 70, "mean")  # over max_batch_images (64): two packs

    async def sizes():  # a PendingRequest is made on an event loop, as in the router
        meta = RequestMetadata("r", "r")
        return [request_size(PendingRequest(args=[], kwargs=kw, metadata=meta)) for kw in SENT_KWARGS]

    asyncio.run(main())
    assert asyncio.run(sizes()) == [(512, 32), (544, 3), (64 * 16, 64), (6 * 16, 6)]


class _Echo(_Encoder):
    """Answers each image with the image itself, so a caller can tell whose outputs it got."""

    def __getattr__(self, name: str):
        method = super().__getattr__(name)
        if name == "describe":
            return method

        def remote(pixels=None, **kwargs):
            method.remote(pixels, **kwargs)  # recorded
            return _Response(list(pixels))

        return SimpleNamespace(remote=remote)


def test_merged_callers_each_get_their_own_images_and_the_call_lives_until_the_last_deadline():
    """Calls merged into one encoder request: a 2-image caller followed by a 1-image one get outputs 0-1 and 2 (by
    image count, not by caller), and the request is sent with the latest of their deadlines (an earlier one would
    have the encoder drop work a caller still waits for)."""
    from deployments.wire import EncodeRequest

    SENT_KWARGS.clear()
    client = EncoderClient(_Echo([]), AppArgs(ingress_batch_size=8), IngressTelemetry())
    a, b, c, d = (np.full((56, 56, 3), i, np.uint8) for i in range(4))
    calls = [
        EncodeRequest([a, b], [16, 16], "mean", deadline=100.0),
        EncodeRequest([c], [16], "mean", deadline=300.0),
        EncodeRequest([d], [16], "mean", deadline=200.0),
    ]
    out = asyncio.run(client._run_merged(calls))
    assert [[int(x[0, 0, 0]) for x in o] for o in out] == [[0, 1], [2], [3]]
    assert [kw["deadline"] for kw in SENT_KWARGS] == [300.0]
