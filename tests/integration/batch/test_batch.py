"""Batch jobs (issue 5): `embed_dataset` and `python -m deployments.batch` on CPU, whole jobs on Ray.

Shares one Ray instance with the other service tests (`tests.serve_fixtures.ray_cluster`). The stages without
Ray are tested in `tests/unit/deployments/batch/test_batch_stages.py`; the data comes from `tests/batch_data.py`.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deployments.batch.job import CRASH_ENV
from deployments.batch.manifest import MANIFEST
from encoder.errors import RandomWeightsWarning
from tests.batch_data import assert_close, cli, good_image, make_rows, read_output, reference

ROOT = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------------- the CLI


@pytest.mark.slow  # a Ray cluster and a whole job
def test_cli_bytes_mean_directory_of_parquet(ray_cluster, tmp_path):
    ids_a, images_a, bad_a = make_rows(150, seed=1, corrupt_every=20)
    ids_b, images_b, _ = make_rows(80, seed=2)
    src = tmp_path / "in"
    src.mkdir()
    for name, ids, images, rg in (("a.parquet", ids_a, images_a, 40), ("b.parquet", ids_b, images_b, 1000)):
        table = pa.table(
            {
                "id": ids,
                "image": pa.array(images, pa.binary()),
                "label": [f"img-{i}" for i in ids],
                "score": np.arange(len(ids)) * 0.5,
            }
        )
        pq.write_table(table, src / name, row_group_size=rg)
    (src / "_SUCCESS").write_text("")  # ignored, as are hidden files
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--part-rows", 64) == 0

    result = read_output(out)
    all_ids = ids_a + ids_b
    assert result.num_rows == len(all_ids)
    assert sorted(result.column("id").to_pylist()) == sorted(all_ids)
    assert result.column_names == ["id", "label", "score", "embedding", "error"]
    assert result.schema.field("embedding").type == pa.list_(pa.float32(), 128)
    errors = dict(zip(result.column("id").to_pylist(), result.column("error").to_pylist(), strict=True))
    assert {i for i, e in errors.items() if e is not None} == bad_a
    labels = dict(zip(result.column("id").to_pylist(), result.column("label").to_pylist(), strict=True))
    assert all(labels[i] == f"img-{i}" for i in all_ids)

    images = dict(zip(ids_a + ids_b, images_a + images_b, strict=True))
    good = [i for i in all_ids if i not in bad_a]
    got = dict(zip(result.column("id").to_pylist(), result.column("embedding").to_pylist(), strict=True))
    for i, want in zip(good, reference([images[i] for i in good], "mean"), strict=True):
        assert_close(np.asarray(got[i], dtype=np.float32), want)
    assert all(got[i] is None for i in bad_a)

    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and len(manifest["parts"]) == math.ceil(157 / 64) + math.ceil(80 / 64)
    assert sum(p["error_rows"] for p in manifest["parts"].values()) == len(bad_a)
    # every part is one input row range, in input order
    for name, info in manifest["parts"].items():
        part_ids = pq.read_table(out / name).column("id").to_pylist()
        assert len(part_ids) == info["num_rows"] and part_ids == sorted(part_ids)


@pytest.mark.slow  # a Ray cluster and a whole job
def test_cli_paths_ipc_per_token(ray_cluster, tmp_path):
    files, paths, want_images = tmp_path / "images", [], {}
    files.mkdir()
    for k in range(40):
        data = good_image(500 + k)
        path = files / f"{k:03d}.img"
        path.write_bytes(data)
        paths.append(str(path))
        want_images[k] = data
    (files / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    paths += [str(files / "missing.png"), str(files / "bad.png")]
    keys = list(range(len(paths)))
    table = pa.table({"key": keys, "path": pa.array(paths, pa.string())})
    src = tmp_path / "in.arrow"
    with pa.ipc.new_file(str(src), table.schema) as writer:
        writer.write_table(table, max_chunksize=16)
    out = tmp_path / "out"
    assert (
        cli(
            "--input",
            src,
            "--output",
            out,
            "--image-column",
            "path",
            "--id-column",
            "key",
            "--pooling",
            "none",
            "--part-rows",
            15,
        )
        == 0
    )

    result = read_output(out)
    assert sorted(result.column("key").to_pylist()) == keys
    schema = result.schema
    assert schema.field("embedding").type == pa.list_(pa.list_(pa.float32(), 128))
    assert [schema.field(c).type for c in ("num_tokens", "grid_h", "grid_w")] == [pa.int32()] * 3
    rows = {r["key"]: r for r in result.to_pylist()}
    assert rows[40]["error"].startswith("FileNotFoundError") and rows[41]["error"].startswith("ImageDecodeError")
    assert rows[40]["embedding"] is None and rows[41]["num_tokens"] == 0
    for k, want in zip(range(40), reference([want_images[k] for k in range(40)], "none"), strict=True):
        row = rows[k]
        assert row["error"] is None and row["num_tokens"] == want.shape[0] == row["grid_h"] * row["grid_w"] // 4
        assert_close(np.asarray(row["embedding"], dtype=np.float32), want)


@pytest.mark.slow  # a Ray cluster and a whole job
def test_cli_killed_then_resumed_gives_every_id_once(ray_cluster, tmp_path):
    import ray

    ids, images, bad = make_rows(90, seed=3, corrupt_every=13)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "image": pa.array(images, pa.binary())}), src, row_group_size=30)
    out = tmp_path / "out"
    args = ["--input", str(src), "--output", str(out), "--part-rows", "20"]
    # Killed (os._exit, no cleanup) right after its 2nd part is renamed into place, before the
    # manifest records it: the worst moment.
    env = {**os.environ, CRASH_ENV: "2"}
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.batch", *args, "--address", address],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 75, proc.stderr[-3000:]
    # a normal run logs no E-level lines (Ray's `core_worker.cc ... max_restarts > 0` was one on every run),
    # and its progress counts images, not Ray Data's blocks per operator
    assert not re.search(r"^\[[^\]]* E \d+ \d+\]", proc.stderr, re.M), proc.stderr[-3000:]
    assert re.search(r"^\[deployments\.batch\] \d+/\d+ images \(\d+%\)", proc.stderr, re.M), proc.stderr[-3000:]
    assert "Progress bars disabled" not in proc.stderr
    # a preset's random weights: one plain line from the driver, and no actor repeating it in warnings' file:line form
    assert proc.stderr.count(f"[deployments.batch] warning: {RandomWeightsWarning.message('tiny')}") == 1, proc.stderr
    assert "RandomWeightsWarning" not in proc.stderr and "(RANDOM weights) on cpu" in proc.stderr, proc.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["parts"]) == 1 and not manifest.get("complete")
    assert len(list(out.glob("part-*.parquet"))) == 2
    (recorded,) = manifest["parts"].values()
    done_ids = set(ids[recorded["rows"][0] : recorded["rows"][1]])
    (out / ".part-000003.parquet.tmp-999").write_bytes(b"half a file")  # a crash mid-write

    from deployments.batch import JobConfig, run_job

    summary = run_job(JobConfig(input=[str(src)], output=str(out), part_rows=20, progress=False))
    assert summary.complete and summary.parts_done == summary.total_parts == math.ceil(len(ids) / 20)
    assert summary.rows == len(ids) - len(done_ids) and summary.error_rows == len(bad - done_ids)
    result = read_output(out)
    assert sorted(result.column("id").to_pylist()) == sorted(ids)  # exactly once each
    errors = dict(zip(result.column("id").to_pylist(), result.column("error").to_pylist(), strict=True))
    assert {i for i, e in errors.items() if e is not None} == bad
    assert not list(out.glob(".*tmp*"))

    # The same command again: nothing to do. Different parameters: refused, output untouched.
    again = run_job(JobConfig(input=[str(src)], output=str(out), part_rows=20, progress=False))
    assert again.complete and again.rows == 0
    assert cli("--input", src, "--output", out, "--part-rows", 20, "--pooling", "none") == 2
    assert sorted(read_output(out).column("id").to_pylist()) == sorted(ids)


@pytest.mark.slow  # a Ray cluster and a whole job
def test_example_runs(ray_cluster):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import batch_job
    finally:
        sys.path.remove(str(ROOT / "examples"))
    import ray.data

    context = ray.data.DataContext.get_current()
    assert context.use_datasource_v2 is True  # Ray 2.60's default, which the example switches off for its read
    with pytest.warns(RandomWeightsWarning, match="'tiny' is a preset with RANDOM weights"):  # from embed_dataset
        table = batch_job.main(num_images=24)
    assert context.use_datasource_v2 is True  # and gives back: the caller's context is not left changed
    assert table.num_rows == 24 and table.schema.field("embedding").type == pa.list_(pa.float32(), 128)
    assert table.column("error").null_count == 24
