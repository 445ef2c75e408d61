"""Batch jobs (issue 5): `embed_dataset` and `python -m deployments.batch` on CPU.

Shares one Ray instance with the other service tests (`tests.serve_fixtures.ray_cluster`).
"""

from __future__ import annotations

import io
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
import torch
from PIL import Image

import encoder
from deployments.batch import EncoderActor, decode_batch, output_schema
from deployments.batch.__main__ import main as cli_main
from deployments.batch.actor import _pixel_rows, fill_order
from deployments.batch.columns import ERROR, PATCHES
from deployments.batch.files import InputFile, Part, plan_parts, read_units
from deployments.batch.job import CRASH_ENV
from deployments.batch.manifest import MANIFEST
from deployments.batch.model_facts import preprocess_config_for
from encoder.errors import InvalidArgumentError, RandomWeightsWarning
from workspace.buckets import BucketKey, BucketTable

ROOT = Path(__file__).resolve().parents[3]
REL_TOL = 1e-5


# ------------------------------------------------------------------------------------- data


def random_picture(seed: int) -> Image.Image:
    """Mixed size (28..120 px sides), mixed mode, random content: a random gradient plus noise."""
    rng = np.random.default_rng(seed)
    h, w = (int(v) for v in rng.integers(28, 121, 2))
    yy, xx = np.mgrid[0:h, 0:w]
    base = rng.uniform(0, 255, 3)[None, None] + rng.uniform(-2, 2, 3)[None, None] * (xx + yy)[..., None]
    pixels = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels)
    mode = ["RGB", "RGB", "L", "RGBA"][seed % 4]
    return img if mode == "RGB" else img.convert(mode)


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def good_image(seed: int) -> bytes:
    img = random_picture(seed)
    fmt = ["PNG", "JPEG", "WEBP"][seed % 3]
    if fmt == "JPEG" and img.mode == "RGBA":
        fmt = "PNG"
    return encoded(img, fmt)


def corrupt_images() -> list[bytes | None]:
    png = good_image(1)
    return [
        png[:60],  # truncated
        b"\x89PNG\r\n\x1a\n" + bytes(range(200)),  # header then garbage
        b"",  # empty
        None,  # null
        b"definitely not an image",
        encoded(Image.fromarray(np.full((2, 500, 3), 7, np.uint8)), "PNG"),  # aspect ratio 250:1
        encoded(random_picture(3).convert("RGB"), "PPM"),  # a format that is not allowed
    ]


def make_rows(n_good: int, seed: int, corrupt_every: int = 0) -> tuple[list[int], list, set[int]]:
    """ids, image bytes, and the ids of the corrupt rows (spread through the data)."""
    ids, images, bad = [], [], set()
    corrupt = corrupt_images() if corrupt_every else []
    total = n_good + len(corrupt)
    for row in range(total):
        ids.append(seed * 100_000 + row)
        if corrupt and row % corrupt_every == corrupt_every - 1 and len(bad) < len(corrupt):
            images.append(corrupt[len(bad)])
            bad.add(ids[-1])
        else:
            images.append(good_image(seed * 100_000 + row))
    assert len(bad) == len(corrupt), "raise n_good so every corrupt kind fits"
    return ids, images, bad


def reference(images: list[bytes], pooling: str) -> list[torch.Tensor]:
    """The eager `VisionEncoder.encode` on the same bytes (the batch job must match it)."""
    return encoder.load("tiny").encode(images, pooling=pooling)


def assert_close(got: np.ndarray, want: torch.Tensor) -> None:
    want = want.numpy()
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1e-6)
    assert float(np.abs(got - want).max()) <= REL_TOL * scale


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    assert parts, f"no parts in {out}"
    return pa.concat_tables([pq.read_table(p) for p in parts])


def cli(*args: str) -> int:
    return cli_main([*map(str, args), "--no-progress"])


# ------------------------------------------------------------------------------------- unit tests


def test_fill_order_cuts_where_the_runner_packs():
    rng = np.random.default_rng(0)
    largest = BucketKey(512, 32)
    table = BucketTable([BucketKey(256, 16), largest])
    for trial in range(50):
        n = int(rng.integers(1, 120))
        counts = [int(c) for c in rng.choice([16, 20, 36, 48, 64, 300, 600], n)]
        sizes = [(c, 1) for c in counts]
        order = fill_order(counts, sizes, largest)
        assert sorted(order) == list(range(n))
        packs = table.pack([counts[i] for i in order])
        # first-fit decreasing: every pack but the last of the in-budget ones is at least half full,
        # and the pack count is the bin count (no pack is split by the runner's greedy cut)
        fitting = [p for p in packs if p.key is not None]
        assert all(p.total * 2 > largest.budget for p in fitting[:-1]), trial
        lower = math.ceil(sum(c for c in counts if c <= 512) / 512)
        assert len(fitting) <= max(1, 2 * lower), trial
        assert sum(p.key is None for p in packs) == sum(c > 512 for c in counts)


def test_decode_batch_never_raises_and_keeps_columns(tmp_path):
    pp = preprocess_config_for("tiny")
    good = good_image(7)
    (tmp_path / "a.png").write_bytes(good)
    table = pa.table(
        {
            "id": [0, 1, 2, 3],
            "image": pa.array(["a.png", str(tmp_path / "a.png"), "missing.png", None], pa.string()),
            "x": [1.5, 2.5, 3.5, 4.5],
        }
    )
    out = decode_batch(table, image_column="image", pp=pp, path_root=str(tmp_path))
    assert out.column_names[:2] == ["id", "x"] and "image" not in out.column_names
    errors = out.column(ERROR).to_pylist()
    assert errors[0] is None and errors[1] is None
    assert errors[2].startswith("FileNotFoundError") and errors[3].startswith("ImageDecodeError")
    assert out.column(PATCHES).to_pylist()[2:] == [0, 0]
    # Hugging Face datasets' Image feature: struct<bytes, path>
    hf = pa.table({"image": pa.array([{"bytes": good, "path": None}, {"bytes": None, "path": "a.png"}])})
    out = decode_batch(hf, image_column="image", pp=pp, path_root=str(tmp_path))
    assert out.column(ERROR).to_pylist() == [None, None]
    assert out.column(PATCHES).to_pylist()[0] == out.column(PATCHES).to_pylist()[1] > 0


def test_actor_matches_encoder_and_marks_errors():
    pp = preprocess_config_for("tiny")
    ids, images, bad = make_rows(30, seed=5, corrupt_every=4)
    decoded = decode_batch(
        pa.table({"id": ids, "image": pa.array(images, pa.binary())}), image_column="image", pp=pp, path_root=None
    )
    # as Ray hands it over after re-batching: several chunks, some of them slices of larger arrays
    decoded = pa.concat_tables([decoded.slice(0, 9), decoded.slice(9, 20), decoded.slice(29)])
    assert decoded.column("_ve_pixels").num_chunks == 3
    for pooling in ("mean", "none"):
        actor = EncoderActor("tiny", pooling, None, preprocess_config=pp)  # the CPU default table
        out = actor(decoded)
        assert out.schema == output_schema(
            pa.schema([("id", pa.int64()), ("image", pa.binary())]), "image", pooling, actor.dim
        )
        errors = out.column(ERROR).to_pylist()
        assert {i for i, e in zip(ids, errors, strict=True) if e} == bad
        good = [(i, img) for i, img in zip(ids, images, strict=True) if i not in bad]
        want = reference([img for _, img in good], pooling)
        got = {i: v for i, v in zip(ids, out.column("embedding").to_pylist(), strict=True)}
        for (i, _), w in zip(good, want, strict=True):
            assert_close(np.asarray(got[i], dtype=np.float32), w)
        assert all(got[i] is None for i in bad)


def test_driver_and_actors_agree_on_the_bucket_table_for_every_backend():
    """The driver sizes Ray Data batches from the table its actors will have: for every attention backend
    usable here the driver's plan (from the model's config) is the actor's own, and for a GPU actor the
    backend's `max_graph_tokens` caps the driver's table as it caps the engine's (sdpa: 8192, not 32768)."""
    from deployments.batch.model_facts import actor_device, actor_graph_cap, actor_plan, rows_per_batch
    from encoder.attention import available_backends
    from workspace import GraphEncoder

    usable = [name for name, why in available_backends().items() if why is None]
    assert "sdpa" in usable
    for name in usable:
        for buckets in (None, "256,512"):
            cap = actor_graph_cap("tiny", "cpu", attention=name)
            actor = EncoderActor("tiny", "mean", buckets, attention=name)
            assert cap == actor.vision.model.backend.max_graph_tokens, name
            assert actor_plan("tiny", "cpu", buckets, cap) == actor.plan, (name, buckets)
            assert actor.engine.table == actor.plan.table
        # on a GPU the device default is the engine default, capped by the backend like the engine's
        vision = encoder.load("tiny", device="cpu", attention=name)
        gpu = actor_plan("tiny", actor_device(1), None, vision.model.backend.max_graph_tokens)
        assert gpu.table == GraphEncoder(vision).table, name
    sdpa = actor_plan("tiny", "cuda", None, actor_graph_cap("tiny", "cpu", attention="sdpa"))
    assert sdpa.table.largest.budget == 8192 and rows_per_batch(sdpa, 256) == 64
    with pytest.raises(InvalidArgumentError, match="drift"):
        EncoderActor("tiny", "mean", None, expected_table=BucketTable.parse("256"))


def test_pixel_rows_from_read_only_shared_memory():
    # Ray hands the actor zero-copy, read-only views of its object store
    raw = np.arange(40, dtype=np.uint8)
    raw.setflags(write=False)
    offsets = pa.array([0, 10, 10, 30, 40], pa.int64()).buffers()[1]
    validity = pa.array([True, False, True, True]).buffers()[1]
    arr = pa.LargeBinaryArray.from_buffers(pa.large_binary(), 4, [validity, offsets, pa.py_buffer(raw)])
    rows = _pixel_rows(pa.chunked_array([arr.slice(0, 2), arr.slice(2)]), torch.device("cpu"))
    assert rows[1] is None
    assert [r.tolist() for r in (rows[0], rows[2], rows[3])] == [
        list(range(10)),
        list(range(10, 30)),
        list(range(30, 40)),
    ]


def test_parts_and_read_units_follow_row_groups():
    files = [InputFile("a.parquet", "parquet", 95, 0, [30, 30, 35]), InputFile("b.arrow", "ipc-file", 25, 0)]
    parts = plan_parts(files, 20)
    assert [(p.file, p.start, p.stop) for p in parts] == [
        (0, 0, 20),
        (0, 20, 40),
        (0, 40, 60),
        (0, 60, 80),
        (0, 80, 95),
        (1, 0, 20),
        (1, 20, 25),
    ]
    todo = [p for p in parts if p.index in (1, 4, 6)]
    units = read_units(files, todo)
    assert [(u["group"], u["ranges"]) for u in units] == [
        (0, [[1, 20, 30]]),
        (1, [[1, 30, 40]]),
        (2, [[4, 80, 95]]),
        (-1, [[6, 20, 25]]),
    ]
    assert Part(3, 0, 0, 1).name == "part-000003.parquet"


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
