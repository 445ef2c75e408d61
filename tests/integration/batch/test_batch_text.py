"""Batch jobs over a text column (`--text-column`): a tiny CLIPModel checkpoint with its tokenizer
(`tests/text_checkpoints.py`), the embeddings equal to `encoder.load(...).encode_text`; null and empty texts are
error rows; a killed job resumes as an image job does; a model without text and an image-only pooling are refused
before Ray starts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import encoder
from deployments.batch.job import CRASH_ENV
from deployments.batch.manifest import MANIFEST
from tests.batch_data import cli, read_output
from tests.text_checkpoints import write_clip

ROOT = Path(__file__).resolve().parents[3]
WORDS = ["cat", "dog", "red", "bicycle", "photo", "of", "a", "Ünïcode", "東京", "😀"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip-batch-text")
    write_clip(directory)
    return directory


def captions(n: int) -> tuple[list[int], list[str | None], set[int]]:
    """ids, captions (every 9th null, every 13th empty) and the ids of those bad rows."""
    rng = np.random.default_rng(0)
    texts: list[str | None] = []
    bad = set()
    for i in range(n):
        if i % 9 == 4:
            texts.append(None)
            bad.add(i)
        elif i % 13 == 6:
            texts.append("")
            bad.add(i)
        else:
            texts.append(" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))))  # some over-long
    return list(range(n)), texts, bad


@pytest.mark.slow  # a Ray cluster and whole jobs
def test_text_column_job_resumes_and_equals_encode_text(ray_cluster, clip_dir, tmp_path):
    ids, texts, bad = captions(70)
    src = tmp_path / "captions.parquet"
    pq.write_table(pa.table({"id": ids, "caption": pa.array(texts, pa.string()), "n": np.arange(70)}), src)
    out = tmp_path / "out"
    args = ["--input", str(src), "--output", str(out), "--text-column", "caption", "--model", str(clip_dir),
            "--part-rows", "20", "--dtype", "float32"]  # fmt: skip
    # killed (os._exit, no cleanup) right after its 2nd part is renamed into place, before the manifest records it
    address = __import__("ray").get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.batch", *args, "--address", address],
        cwd=ROOT, env={**os.environ, CRASH_ENV: "2"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "texts" in proc.stderr, proc.stderr[-3000:]
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["parts"]) == 1 and manifest["params"]["text_column"] == "caption"

    # the same command resumes; the text actor's start-up line reaches the driver (Ray forwards actors' lines a
    # moment later, so it is looked for in this run, which outlives its actor's start, not in the killed one)
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.batch", *args, "--address", address],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens per text" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and len(manifest["parts"]) == math.ceil(70 / 20)
    result = read_output(out)
    assert result.column_names == ["id", "n", "embedding", "error"]  # every input column but the text column
    assert sorted(result.column("id").to_pylist()) == ids  # exactly once each
    ref = encoder.load(clip_dir, device="cpu", dtype="float32")
    dim = ref.text.config.out_dim
    assert result.schema.field("embedding").type == pa.list_(pa.float32(), dim)
    rows = {r["id"]: r for r in result.to_pylist()}
    assert {i for i, r in rows.items() if r["error"] is not None} == bad
    assert rows[4]["error"] == "InvalidArgumentError: text is null" and rows[4]["embedding"] is None
    assert rows[6]["error"] == "InvalidArgumentError: text is an empty string"
    good = [i for i in ids if i not in bad]
    want = ref.encode_text([texts[i] for i in good])
    for i, w in zip(good, want, strict=True):
        np.testing.assert_allclose(np.asarray(rows[i]["embedding"], np.float32), w.numpy(), rtol=1e-4, atol=1e-5)
    assert sum(p["error_rows"] for p in manifest["parts"].values()) == len(bad)

    # again: nothing to do; another pooling is another job (refused here: the output is this one's)
    assert cli(*args) == 0 and len(read_output(out)) == 70
    assert cli(*args, "--pooling", "model-l2") == 2


def test_text_jobs_are_refused_before_ray_for_a_model_without_text_or_an_image_pooling(clip_dir, tmp_path, capsys):
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1], "caption": ["a cat"], "blob": pa.array([b"x"], pa.binary())}), src)
    base = ["--input", src, "--output", tmp_path / "out", "--text-column"]
    assert cli(*base, "caption", "--model", "tiny-clip") == 2
    assert "takes no text" in capsys.readouterr().err
    assert cli(*base, "caption", "--model", clip_dir, "--pooling", "mean") == 2
    assert "not a text pooling" in capsys.readouterr().err
    assert cli(*base, "blob", "--model", clip_dir) == 2
    assert "expected string" in capsys.readouterr().err
    assert cli(*base, "missing", "--model", clip_dir) == 2
    assert "no column 'missing'" in capsys.readouterr().err
