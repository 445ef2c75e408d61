"""The encoder replica's one start-up line (`replica.startup_summary`), on the tiny preset on CPU."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import encoder
from deployments.config import AppArgs, replica_plan
from deployments.replica.deployment import startup_summary
from workspace import GraphEncoder


def test_startup_summary_names_model_weights_device_attention_buckets_and_capture():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", encoder.RandomWeightsWarning)
        vision = encoder.load("tiny", device="cpu")
    plan = replica_plan(AppArgs(), vision, "cpu")
    stats = GraphEncoder(vision, plan.table).stats()
    pipeline = SimpleNamespace(pipeline_depth=1, text_seq_len=0, max_batch_texts=0)
    line = startup_summary(vision, plan, stats, 2.25, pipeline)
    assert "\n" not in line
    assert line.startswith("encoder ready: tiny, RANDOM weights (preset), cpu float32, attention full=auto (")
    assert "window=auto (" in line  # Qwen2.5-VL's two layer kinds, each with its backend
    assert "buckets 256,1024 (0 graphs captured in 0.0s, 0 MiB)" in line
    assert (
        "batches up to 8192 patches / 32 images (1 in flight); images only (no text tower with its tokenizer); " in line
    )
    assert line.endswith("started in 2.2s")
    text = startup_summary(
        vision, plan, stats, 2.25, SimpleNamespace(pipeline_depth=1, text_seq_len=77, max_batch_texts=256)
    )
    assert "(1 in flight); text 77 tokens, up to 256 texts a batch; started in 2.2s" in text
    off = startup_summary(vision, plan, stats, 2.25, pipeline, text_enabled=False)  # the application's text=false
    assert "(1 in flight); images only (text=false); started in 2.2s" in off
    imports = startup_summary(vision, plan, stats | {"imports_seconds": 4.25}, 2.25, pipeline)
    assert imports.endswith("; started in 2.2s after 4.2s of imports")  # the cold start's import phase
