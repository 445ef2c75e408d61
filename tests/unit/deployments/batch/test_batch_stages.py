"""The batch job's stages without Ray (issue 5): planning parts and read units, decoding, the encoder actor
against the eager encoder, and the bucket table the driver and the actors share."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import encoder
from deployments.batch import EncoderActor, decode_batch, output_schema
from deployments.batch.actor import _pixel_rows, fill_order
from deployments.batch.columns import ERROR, PATCHES
from deployments.batch.files import (
    PART_COLUMN,
    ROW_COLUMN,
    InputFile,
    Part,
    inspect_input,
    plan_parts,
    read_batch,
    read_units,
)
from deployments.batch.model_facts import preprocess_config_for
from encoder.errors import InvalidArgumentError
from tests.batch_data import assert_close, good_image, make_rows, reference
from workspace.buckets import BucketKey, BucketTable


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
    # an exact fit has room: 300 + 212 fill the first bin, 200 starts the second
    assert fill_order([300, 212, 200], [(1, 1), (2, 1), (3, 1)], largest) == [0, 1, 2]


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


def test_decode_batch_refuses_a_png_text_chunk_bomb(monkeypatch):
    """A decode task is a process of ours like the ingress (issue 44 case 8): Pillow's text-chunk limit is ours
    (8 MiB, not Pillow's 64), so 60 MB of zTXt is an error row, not pixels."""
    import warnings

    from PIL import Image, PngImagePlugin

    from tests.images_util import png_with_text

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # decode_batch's are process-wide
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", 64 * 2**20)  # Pillow's default: a fresh Ray worker's
    table = pa.table({"image": pa.array([png_with_text(512, 60)], pa.binary())})
    with warnings.catch_warnings():  # and the warning filter it adds
        out = decode_batch(table, image_column="image", pp=preprocess_config_for("tiny"), path_root=None)
    (error,) = out.column(ERROR).to_pylist()
    assert error is not None and error.startswith("ImageTooComplexError: PNG text chunks"), error


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
    files = [InputFile("a.parquet", "parquet", 95, 0, 0, [30, 30, 35]), InputFile("b.arrow", "ipc-file", 25, 0, 0)]
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
    todo = [p for p in parts if p.index in (1, 3, 4, 6)]  # part 3 starts where row group 2 does
    units = read_units(files, todo)
    assert [(u["group"], u["ranges"]) for u in units] == [
        (0, [[1, 20, 30]]),
        (1, [[1, 30, 40]]),  # no empty [3, 60, 60] range
        (2, [[3, 60, 80], [4, 80, 95]]),
        (-1, [[6, 20, 25]]),
    ]
    assert Part(3, 0, 0, 1).name == "part-000003.parquet"


def test_read_batch_emits_each_units_rows_tagged_with_part_and_row(tmp_path):
    """Rows of a row group that starts mid-file are sliced relative to the group, not the file."""
    pq.write_table(pa.table({"id": [10 * r for r in range(95)]}), tmp_path / "a.parquet", row_group_size=30)
    ipc = pa.table({"id": [-r for r in range(25)]})
    with pa.ipc.new_file(str(tmp_path / "b.arrow"), ipc.schema) as writer:
        writer.write_table(ipc)
    files = [inspect_input(tmp_path / name)[0] for name in ("a.parquet", "b.arrow")]
    assert files[0].row_groups == [30, 30, 30, 5]
    parts = plan_parts(files, 20)
    todo = [p for p in parts if p.index in (1, 4, 6)]  # rows 20..40 (two groups), 80..95 (two groups), b 20..25
    units = [json.dumps(u) for u in read_units(files, todo)]
    got = read_batch(pa.table({"unit": units}))
    rows = list(range(20, 40)) + list(range(80, 95))
    assert got.column(ROW_COLUMN).to_pylist() == rows + list(range(20, 25))
    assert got.column(PART_COLUMN).to_pylist() == [1] * 20 + [4] * 15 + [6] * 5
    assert got.column("id").to_pylist() == [10 * r for r in rows] + [-r for r in range(20, 25)]


def test_an_image_that_fails_the_encoder_alone_is_an_error_row_and_all_failing_fails_the_batch():
    """A batch that raises is retried image by image: the culprit becomes an error row, the others are embedded;
    when every image fails alone the fault is not the data, and the batch raises."""
    pp = preprocess_config_for("tiny")
    ids, images, _ = make_rows(6, seed=11)
    decoded = decode_batch(
        pa.table({"id": ids, "image": pa.array(images, pa.binary())}), image_column="image", pp=pp, path_root=None
    )
    actor = EncoderActor("tiny", "mean", None, preprocess_config=pp)
    real_patch_batch, real_run = actor._patch_batch, actor._run
    culprits = {2}

    def run(batch):
        order, patches = batch
        if culprits & set(order):
            raise RuntimeError("boom")
        return real_run(patches)

    actor._patch_batch = lambda order, *args: (order, real_patch_batch(order, *args))
    actor._run = run
    out = actor(decoded)
    errors = out.column(ERROR).to_pylist()
    assert errors[2] == "encode failed: RuntimeError: boom" and out.column("embedding")[2].as_py() is None
    assert errors[:2] + errors[3:] == [None] * 5
    want = reference(images[:2] + images[3:], "mean")
    got = [np.asarray(v, dtype=np.float32) for v in out.column("embedding").to_pylist()]
    for g, w in zip(got[:2] + got[3:], want, strict=True):
        assert_close(g, w)
    culprits.update(range(len(ids)))
    with pytest.raises(RuntimeError, match="boom"):
        actor(decoded)
