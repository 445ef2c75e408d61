"""The encoder replica's `DevicePipeline` on a CPU `tiny` engine (no Ray): its Prometheus metrics (a batch adds its
own work; the queue-depth gauge follows the requests back down; names in Prometheus's conventions) and its
deadline backstop."""

from __future__ import annotations

import asyncio

import numpy as np

import encoder
from deployments.config import AppArgs, replica_plan
from deployments.replica.health import probe_pixels
from deployments.replica.pipeline import DevicePipeline, check_pixels, engine_delta
from deployments.wire import EncodeRequest
from encoder.patchify import stack_patchify
from tests.images_util import random_array
from workspace import GraphEncoder


class _Gauge:
    def __init__(self):
        self.values: list[float] = []

    def set(self, value: float) -> None:
        self.values.append(value)


class _Metrics:
    """`ReplicaMetrics`' surface that the pipeline uses, recording what it is given."""

    def __init__(self):
        self.queue_depth = _Gauge()
        self.batches: list[dict] = []

    def batch(self, **kwargs) -> None:
        self.batches.append(kwargs)


def tiny_pipeline() -> tuple[encoder.VisionEncoder, DevicePipeline, _Metrics]:
    """The tiny model's replica pipeline on CPU: continuous batching, one batch in flight, no batch wait."""
    vision = encoder.load("tiny", device="cpu")
    plan = replica_plan(AppArgs(model="tiny"), vision, "cpu")
    metrics = _Metrics()
    pipeline = DevicePipeline(
        GraphEncoder(vision, plan.table), plan, batcher="continuous", pipeline_depth=1, fixed_cost=None,
        batch_wait_timeout_s=0.0, metrics=metrics,
    )  # fmt: skip
    return vision, pipeline, metrics


def test_a_batch_counts_its_own_replays_not_the_health_probes():
    """Broken: the batch's replays and padding were the differences of the engine's totals since the last batch,
    which hold the start-up and health-check encodes too (17 replays counted for 2 one-image requests, with a
    health check every second), and the queue-depth gauge stayed at a burst's peak after it was served."""
    vision, pipeline, metrics = tiny_pipeline()
    engine = pipeline.engine
    pp = vision.preprocess_config
    probe = stack_patchify(probe_pixels(pp), pp, engine.device)
    image = random_array(pp.factor * 4, pp.factor * 3, 3, seed=5)  # 4x3 merge units: 48 patches

    async def main():
        for _ in range(3):  # what the health probe does between batches, in the device thread
            await pipeline.on_device_thread(engine.encode, probe, "mean")
        work = EncodeRequest(*check_pixels([image], pp), "mean")
        return await pipeline.submit(work, 0.0)

    before = engine.stats()
    try:
        (vector,) = asyncio.run(main())
    finally:
        pipeline.shutdown()
    assert vector.shape == (vision.out_dim,) and np.isfinite(vector).all()
    (batch,) = metrics.batches
    assert (batch["requests"], batch["images"], batch["patches"]) == (1, 1, 48)
    assert sum(engine_delta(before, engine.stats())["replays"].values()) == 4  # the probes' replays and the batch's
    budget = engine.table.bucket_for(48, 1).budget
    assert batch["engine"] == {"padded_patches": budget - 48, "eager_runs": 0, "replays": {budget: 1}}
    assert metrics.queue_depth.values == [1, 0]  # up with the request, down once it is answered


def test_metric_names_follow_prometheus_conventions():
    """Durations in seconds, named `_seconds` (they were `_ms` histograms in milliseconds); no unit-less time."""
    from ray.util.metrics import Histogram

    from deployments.metrics import IngressMetrics, ReplicaMetrics

    metrics = [m for owner in (IngressMetrics(), ReplicaMetrics()) for m in vars(owner).values() if hasattr(m, "_name")]
    names = {m._name for m in metrics}
    assert len(names) == len(metrics) and all(n.startswith("vision_") for n in names), names
    assert not [n for n in names if n.endswith("_ms")], names
    timed = {
        m._name: m
        for m in metrics
        if isinstance(m, Histogram) and any(w in m._name for w in ("latency", "wait", "probe"))
    }
    assert set(timed) == {
        "vision_request_latency_seconds", "vision_encoder_queue_wait_seconds",
        "vision_encoder_batch_latency_seconds", "vision_encoder_health_probe_seconds",
    }, set(timed)  # fmt: skip
    for name, histogram in timed.items():
        assert name.endswith("_seconds") and max(histogram.boundaries) <= 60, (name, histogram.boundaries)


def test_work_past_its_deadline_is_dropped_unrun_by_the_replica():
    """The replica's own backstop (`replica_pipeline._expired`): work whose deadline passed more than the clock
    grace ago is refused before it runs; within the grace it runs (the ingress cancels it itself). No test ran
    the replica's rule (the batcher's tests give it their own)."""
    import time

    import pytest

    vision, pipeline, metrics = tiny_pipeline()
    pp = vision.preprocess_config
    image = random_array(pp.factor * 2, pp.factor * 2, 3, seed=6)

    def submit(deadline: float):
        return asyncio.run(pipeline.submit(EncodeRequest(*check_pixels([image], pp), "mean", deadline=deadline), 0.0))

    try:
        with pytest.raises(TimeoutError, match="dropped unrun"):
            submit(time.time() - 30)
        assert metrics.batches == []  # nothing ran
        (vector,) = submit(time.time() - 0.2)  # late by less than the clocks' grace: run
        assert np.isfinite(vector).all() and len(metrics.batches) == 1
    finally:
        pipeline.shutdown()


def test_each_request_of_a_merged_batch_gets_its_own_images_outputs():
    """A batch of requests is one engine call; its outputs are split back per request, by image count: a request
    of 2 images followed by one of 1 must get outputs 0-1 and 2. And the batch holds at most `max_batch_images`."""
    vision, pipeline, metrics = tiny_pipeline()
    pipeline.max_batch_images = 3
    pp = vision.preprocess_config
    images = [random_array(pp.factor * (2 + i % 2), pp.factor * 2, 3, seed=40 + i) for i in range(5)]
    requests = [images[:1], images[1:3], images[3:4], images[4:5]]  # the first runs alone, the rest queue behind it

    async def main():
        works = [EncodeRequest(*check_pixels(r, pp), "mean") for r in requests]
        merged = await asyncio.gather(*(pipeline.submit(w, 0.0) for w in works))
        alone = [(await pipeline.submit(EncodeRequest(*check_pixels([x], pp), "mean"), 0.0))[0] for x in images]
        return merged, alone

    try:
        merged, alone = asyncio.run(main())
    finally:
        pipeline.shutdown()
    assert [(b["requests"], b["images"]) for b in metrics.batches[:3]] == [(1, 1), (2, 3), (1, 1)]
    got = [v for outputs in merged for v in outputs]
    assert [len(o) for o in merged] == [1, 2, 1, 1]
    for g, want in zip(got, alone, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)
