"""The encoder replica's `DevicePipeline` with texts, on a CPU engine of a tiny CLIP checkpoint with its tokenizer
(no Ray): the text batch limit is the engine's (`GraphEncoder.max_text_batch`, its largest text graph), queued
requests merge up to it and a larger one runs alone; every text comes back with the eager encoder's vector and its
real tokens, in order, through the async text path (`encode_text_ids_async`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import encoder
from deployments.config import AppArgs, replica_plan
from deployments.replica.pipeline import DevicePipeline
from deployments.wire import TextRequest
from tests.text_checkpoints import write_clip
from tests.unit.deployments.replica.test_replica_metrics import _Metrics
from workspace import GraphEncoder
from workspace.text_buckets import MAX_GRAPH_TEXTS, TextTable

TEXTS = ["a red bicycle", "a photo of a cat", "Ünïcode façade — 東京 😀", "cat " * 40, "x", "two\nlines", "dog", "a"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip")
    write_clip(directory)
    return encoder.load(directory, device="cpu", dtype="float32")


def pipeline_of(vision, text_buckets=None) -> tuple[DevicePipeline, _Metrics]:
    plan = replica_plan(AppArgs(model="tiny"), vision, "cpu")
    metrics = _Metrics()
    engine = GraphEncoder(vision, plan.table, text_buckets=text_buckets)
    pipeline = DevicePipeline(
        engine, plan, batcher="continuous", pipeline_depth=1, fixed_cost=None, batch_wait_timeout_s=0.0,
        metrics=metrics,
    )  # fmt: skip
    return pipeline, metrics


def test_the_text_batch_limit_is_the_engines_largest_text_graph(clip, tmp_path):
    pipeline, _ = pipeline_of(clip)
    try:
        assert pipeline.max_batch_texts == pipeline.engine.max_text_batch == MAX_GRAPH_TEXTS
        assert pipeline.text_seq_len == clip.text.config.seq_len
    finally:
        pipeline.shutdown()
    small, _ = pipeline_of(clip, TextTable((1, 2, 4), (clip.text.config.seq_len,)))
    try:
        assert small.max_batch_texts == 4
        assert small._text_fits(0, 4) and not small._text_fits(0, 5)
    finally:
        small.shutdown()
    write_clip(tmp_path, with_tokenizer=False)  # images only: no text batches
    images_only, _ = pipeline_of(encoder.load(tmp_path, device="cpu", dtype="float32"))
    try:
        assert images_only.max_batch_texts == 0 and images_only.text_seq_len == 0
    finally:
        images_only.shutdown()


def test_text_requests_merge_up_to_the_engines_batch_and_get_their_own_vectors(clip):
    """Requests of 1, 2, 2, 1 and 1 texts behind one another through an engine whose largest text graph holds 4:
    no batch holds more than 4 texts, and merging happened (a batch of more than one request); a request of 6 runs
    alone (the engine takes it in chunks). Each text gets the eager encoder's vector and its real tokens."""
    seq_len = clip.text.config.seq_len
    pipeline, metrics = pipeline_of(clip, TextTable((1, 2, 4), (seq_len,)))
    requests = [TEXTS[:1], TEXTS[1:3], TEXTS[3:5], TEXTS[5:6], TEXTS[6:7]]

    async def main():
        works = [TextRequest(r, [seq_len] * len(r), "model", None) for r in requests]
        merged = await asyncio.gather(*(pipeline.submit(w, 0.0) for w in works))
        alone = await pipeline.submit(TextRequest(TEXTS[:6], [seq_len] * 6, "model-l2", None), 0.0)
        return merged, alone

    try:
        merged, alone = asyncio.run(main())
    finally:
        pipeline.shutdown()
    for texts, answer in zip(requests, merged, strict=True):
        want = clip.encode_text(texts)
        assert [n for _, n in answer] == clip.text_tokens(texts)
        for (vector, _), w in zip(answer, want, strict=True):
            assert vector.dtype == np.float32 and float(np.abs(w.numpy()).max()) > 0
            np.testing.assert_allclose(vector, w.numpy(), rtol=1e-5, atol=1e-6)
    want = clip.encode_text(TEXTS[:6], pooling="model-l2")
    for (vector, n), w, tokens in zip(alone, want, clip.text_tokens(TEXTS[:6]), strict=True):
        np.testing.assert_allclose(vector, w.numpy(), rtol=1e-5, atol=1e-6)
        assert n == tokens
    sizes = [b["images"] for b in metrics.batches]  # texts per batch
    assert sum(sizes) == 7 + 6 and sizes[-1] == 6
    assert max(sizes[:-1]) <= 4 and max(b["requests"] for b in metrics.batches[:-1]) > 1, metrics.batches
