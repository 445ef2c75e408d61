"""Batch jobs over a video column (`--video-column`, issue 47 item 1): the `tiny-qwen3-vl` preset, short videos made
with PyAV in the test, as bytes and as file paths. Embeddings equal `VisionEncoder.encode` of `preprocess_video`
of the same bytes (pooling mean: one vector per video; none: the tokens and the grid, t > 1, and the video's facts:
Qwen3-VL's `timestamps`, Qwen2.5-VL's (`tiny`) `second_per_grid_ts`, as `preprocess_video` gives them, in both
layouts); bad videos (truncated, not a video, null, a missing file) are error rows; a killed job resumes as an image
job does; a tower without video is refused before Ray starts. The actor test needs no Ray."""

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
from deployments.batch import EncoderActor, decode_batch, output_schema
from deployments.batch.job import CRASH_ENV
from deployments.batch.manifest import MANIFEST
from deployments.batch.model_facts import deepstack_layers
from tests.batch_data import cli, read_output
from tests.video_util import make_video

ROOT = Path(__file__).resolve().parents[3]
MODEL = "tiny-qwen3-vl"


def clips() -> list[bytes | None]:
    good = [make_video(9, 48, 64, fps=10), make_video(6, 40, 40, fps=4, seed=3), make_video(4, 32, 48, fps=2, seed=5)]
    return [good[0], good[0][: len(good[0]) // 2], good[1], b"not a video", None, good[2]]


BAD = {1: "VideoDecodeError", 3: "VideoDecodeError", 4: "ImageDecodeError"}


@pytest.fixture(scope="module")
def ref():
    return encoder.load(MODEL, device="cpu", dtype="float32")


def float32(value):
    """A fact as a float32 column reads back (None stays None)."""
    if value is None:
        return None
    return np.float32(value).tolist()


def check_facts(rows: dict, good: list[int], batch, kind: str) -> None:
    """Each good row's `timestamps` and `second_per_grid_ts` are `preprocess_video`'s (`batch`, of the good rows
    in order), the one the tower lacks null; error rows have neither."""
    for j, i in enumerate(good):
        stamps, per_grid = batch.timestamps_of(j), batch.second_per_grid_ts_of(j)
        assert (stamps is not None, per_grid is not None) == (kind == "qwen3", kind == "qwen2")
        assert rows[i]["timestamps"] == float32(stamps) and rows[i]["second_per_grid_ts"] == float32(per_grid)
        if stamps is not None:
            assert len(rows[i]["timestamps"]) == rows[i]["grid_t"]
    for i in set(rows) - set(good):
        assert rows[i]["timestamps"] is None and rows[i]["second_per_grid_ts"] is None


@pytest.mark.parametrize("model", [MODEL, "tiny"])  # Qwen3-VL (timestamps), Qwen2.5-VL (second_per_grid_ts)
def test_actor_writes_each_videos_facts_beside_its_tokens(model, tmp_path):
    vision = encoder.load(model, device="cpu", dtype="float32")
    videos = clips()
    table = pa.table({"id": list(range(6)), "clip": pa.array(videos, pa.binary())})
    decoded = decode_batch(
        table, image_column="clip", pp=vision.preprocess_config, path_root=None, video_cfg=vision.video_config
    )
    good = [i for i in range(6) if i not in BAD]
    batch = vision.preprocess_video([videos[i] for i in good])
    want = dict(zip(good, vision.encode_llm(batch), strict=True))
    layers = deepstack_layers(vision.config)
    for layout in ("parts", "vllm"):
        actor = EncoderActor(model, "none", dtype="float32", layout=layout)
        out = actor(decoded)
        assert out.schema == output_schema(table.schema, "clip", "none", actor.dim, layers, layout=layout, video=True)
        assert out.schema.field("timestamps").type == pa.list_(pa.float32())
        assert out.schema.field("second_per_grid_ts").type == pa.float32()
        rows = {r["id"]: r for r in out.to_pylist()}
        assert {i for i, r in rows.items() if r["error"]} == set(BAD)
        check_facts(rows, good, batch, vision.video_config.kind)
        for i, w in want.items():
            assert rows[i]["grid_thw"] == list(w.grid_thw)
            tensor = w.vllm_embeds() if layout == "vllm" else w.tokens
            np.testing.assert_allclose(np.asarray(rows[i]["embedding"], np.float32), tensor.numpy(), atol=1e-4)
    # the tensors as files for vLLM's disk connector: the row keeps its grid and its facts
    named = decoded.append_column("uuid", pa.array([f"v{i}" for i in range(6)]))
    actor = EncoderActor(model, "none", dtype="float32", ec_cache_dir=str(tmp_path), uuid_column="uuid")
    out = actor(named)
    schema = table.schema.append(pa.field("uuid", pa.string()))
    assert out.schema == output_schema(schema, "clip", "none", actor.dim, layers, ec_cache=True, video=True)
    rows = {r["id"]: r for r in out.to_pylist()}
    assert all(rows[i]["ec_cache"] for i in good)
    check_facts(rows, good, batch, vision.video_config.kind)
    # pooled outputs carry no tokens and no grid: no facts either; an image job's schema has none
    actor = EncoderActor(model, "mean", dtype="float32")
    assert actor(decoded).schema == output_schema(table.schema, "clip", "mean", actor.dim, video=True)
    assert "timestamps" not in output_schema(table.schema, "clip", "mean", actor.dim, video=True).names
    assert "timestamps" not in output_schema(table.schema, "clip", "none", actor.dim, layers).names


@pytest.mark.slow  # a Ray cluster and whole jobs
def test_video_column_job_resumes_and_equals_encode(ray_cluster, ref, tmp_path):
    videos = clips()
    src = tmp_path / "videos.parquet"
    pq.write_table(pa.table({"id": list(range(6)), "clip": pa.array(videos, pa.binary())}), src)
    out = tmp_path / "out"
    args = ["--input", str(src), "--output", str(out), "--video-column", "clip", "--model", MODEL,
            "--part-rows", "2", "--dtype", "float32", "--pooling", "mean"]  # fmt: skip
    address = __import__("ray").get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.batch", *args, "--address", address],
        cwd=ROOT, env={**os.environ, CRASH_ENV: "2"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 75, proc.stderr[-3000:]
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["parts"]) == 1 and manifest["params"]["video_column"] == "clip"

    assert cli(*args) == 0  # the same command resumes
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and len(manifest["parts"]) == math.ceil(6 / 2)
    result = read_output(out)
    assert result.column_names == ["id", "embedding", "error"]
    rows = {r["id"]: r for r in result.to_pylist()}
    assert sorted(rows) == list(range(6))
    assert {i: r["error"].split(":")[0] for i, r in rows.items() if r["error"] is not None} == BAD
    good = [i for i in range(6) if i not in BAD]
    want = ref.encode(ref.preprocess_video([videos[i] for i in good]), pooling="mean")
    for i, w in zip(good, want, strict=True):
        np.testing.assert_allclose(np.asarray(rows[i]["embedding"], np.float32), w.numpy(), atol=1e-4)
    assert cli(*args) == 0 and len(read_output(out)) == 6  # again: nothing to do


@pytest.mark.slow
def test_video_jobs_with_pooling_none_give_tokens_grid_and_facts(ray_cluster, ref, tmp_path):
    videos = clips()
    paths = []
    for i, v in enumerate(videos[:3]):
        path = tmp_path / f"clip{i}.mp4"
        path.write_bytes(v)
        paths.append(str(path))
    paths.append(str(tmp_path / "missing.mp4"))
    src = tmp_path / "paths.parquet"
    pq.write_table(pa.table({"id": list(range(4)), "path": paths}), src)
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--video-column", "path", "--model", MODEL, "--dtype", "float32",
               "--pooling", "none") == 0  # fmt: skip
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    assert rows[1]["error"].startswith("VideoDecodeError") and "missing.mp4" in rows[3]["error"]
    batch = ref.preprocess_video([videos[0], videos[2]])
    want = ref.encode_llm(batch)
    for i, w in zip([0, 2], want, strict=True):
        assert rows[i]["grid_thw"] == list(w.grid_thw) and rows[i]["grid_t"] == w.grid_thw[0] > 1
        np.testing.assert_allclose(np.asarray(rows[i]["embedding"], np.float32), w.tokens.numpy(), atol=1e-4)
        assert len(rows[i]["deepstack"]) == len(w.deepstack)
    check_facts(rows, [0, 2], batch, "qwen3")  # Qwen3-VL: each video's timestamps

    # Qwen2.5-VL in vLLM's layout: each video's second_per_grid_ts beside its tensor
    src = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"id": list(range(3)), "clip": pa.array(videos[:3], pa.binary())}), src)
    out = tmp_path / "out-vllm"
    assert cli("--input", src, "--output", out, "--video-column", "clip", "--model", "tiny", "--dtype", "float32",
               "--layout", "vllm") == 0  # fmt: skip
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["params"]["video_columns"] == ["timestamps", "second_per_grid_ts"]
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    qwen25 = encoder.load("tiny", device="cpu", dtype="float32")
    batch = qwen25.preprocess_video([videos[0], videos[2]])
    for i, w in zip([0, 2], qwen25.encode_llm(batch), strict=True):
        assert rows[i]["grid_thw"] == list(w.grid_thw) and "deepstack" not in rows[i]
        np.testing.assert_allclose(np.asarray(rows[i]["embedding"], np.float32), w.vllm_embeds().numpy(), atol=1e-4)
    check_facts(rows, [0, 2], batch, "qwen2")


def test_video_jobs_are_refused_before_ray_for_a_tower_without_video(tmp_path, capsys):
    src = tmp_path / "v.parquet"
    pq.write_table(pa.table({"id": [1], "clip": pa.array([b"x"], pa.binary())}), src)
    base = ["--input", src, "--output", tmp_path / "out", "--video-column", "clip"]
    assert cli(*base, "--model", "tiny-clip") == 2
    assert "takes no video" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # a usage error: argparse's exit
        cli(*base, "--model", MODEL, "--text-column", "clip")
    assert exited.value.code == 2 and "video_column and text_column" in capsys.readouterr().err
