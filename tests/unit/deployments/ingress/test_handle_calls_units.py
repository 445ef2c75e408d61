"""`HandleCalls` (the ingress's `embed` / `embed_llm` handle methods) against a fake encoder client and decoder,
without Serve (fast). End to end: test_serve.py and test_llm_outputs_serve.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.config import AppArgs
from deployments.ingress.handle_calls import HandleCalls
from deployments.ingress.limits import Admission
from deployments.metrics import IngressTelemetry
from encoder.errors import InvalidArgumentError


class FakeClient:
    def __init__(self):
        self.calls = []

    async def info(self) -> dict:
        return {"vector_pooling": "model", "output_dims": {"model": 4, "mean": 4}, "preprocess_config": None}

    async def encode(self, arrays, pooling, llm, deadline):
        self.calls.append((len(arrays), pooling, llm))
        return [np.full(4, i, np.float32) for i in range(len(arrays))], 3


class FakeDecoder:
    async def prepare(self, images, pp, where, max_patches, reserve):
        return list(images)


def handle() -> tuple[HandleCalls, FakeClient]:
    client = FakeClient()
    return HandleCalls(AppArgs(), client, FakeDecoder(), Admission(4), IngressTelemetry()), client


def test_embed_without_pooling_takes_the_models_default_and_returns_its_float32_arrays():
    h, client = handle()
    got = asyncio.run(h([b"a", b"b"], None, None))
    assert client.calls == [(2, "model", None)]  # CLIP / SigLIP: "model", not "mean"
    assert [type(v) for v in got] == [np.ndarray] * 2 and [v.dtype for v in got] == [np.float32] * 2
    assert [v[0] for v in got] == [0.0, 1.0]  # in input order
    assert len(asyncio.run(h(b"one", "mean", None))) == 1 and client.calls[-1] == (1, "mean", None)  # one image


@pytest.mark.parametrize("pooling,llm", [("max", None), (None, "int8"), ("none", np.float16)])
def test_a_bad_pooling_or_dtype_is_refused_even_without_images(pooling, llm):
    """An empty list is answered [] only for a valid call: a bad argument is an error whatever the images."""
    h, client = handle()
    with pytest.raises(InvalidArgumentError):
        asyncio.run(h([], pooling, llm))
    assert asyncio.run(h([], "none", "bfloat16")) == [] and client.calls == []


def test_a_pooling_the_model_lacks_is_refused_at_the_ingress_and_everything_is_released():
    """The lifecycle resolves pooling once, against the model (`describe()["output_dims"]`): "none" on a model
    without it never reaches the encoder; the request's slot and bytes are released, its outcome counted."""
    h, client = handle()
    with pytest.raises(InvalidArgumentError, match="pooling 'none' is not offered by the served model"):
        asyncio.run(h([b"a"], "none", None))
    assert client.calls == []
    admission = h._lifecycle._admission
    assert (admission.inflight, admission.bytes, admission.patches) == (0, 0, 0)


def test_a_cancelled_call_releases_what_it_held():
    h, client = handle()

    async def hang(arrays, pooling, llm, deadline):
        await asyncio.sleep(60)

    client.encode = hang

    async def main():
        task = asyncio.create_task(h([b"abc"], None, None))
        await asyncio.sleep(0.05)
        admission = h._lifecycle._admission
        assert (admission.inflight, admission.bytes) == (1, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return admission

    admission = asyncio.run(main())
    assert (admission.inflight, admission.bytes, admission.patches) == (0, 0, 0)
    assert h._lifecycle._telemetry.counts["disconnected"] == 1
