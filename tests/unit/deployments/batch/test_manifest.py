"""`deployments.batch.manifest`: what resuming a batch job trusts (no Ray, no model)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

import deployments.batch.manifest as manifest_module
from deployments.batch.files import PART_COLUMN, ROW_COLUMN, JobError, Part
from deployments.batch.manifest import MANIFEST, Manifest, locked, write_part

PARAMS = {"inputs": [{"path": "/data/a.parquet", "rows": 30, "bytes": 123}], "model": "tiny", "part_rows": 20}


def rows(part: Part, order) -> pa.Table:
    return pa.table({"id": list(order), PART_COLUMN: [part.index] * len(order), ROW_COLUMN: list(order)})


def test_a_new_manifest_records_parts_and_runs_and_reopens_with_them(tmp_path):
    manifest = Manifest.open(tmp_path, PARAMS)
    assert manifest.done() == set() and not (tmp_path / MANIFEST).exists()  # nothing written yet
    part = Part(0, 0, 0, 20)
    write_part(tmp_path, part, [rows(part, range(10, 20)), rows(part, range(10))])
    manifest.record_part(part, "/data/a.parquet", error_rows=2)
    manifest.record_run({"rows": 20})
    manifest.finish(False)
    again = Manifest.open(tmp_path, PARAMS)
    assert again.done() == {"part-000000.parquet"}
    assert again.data["parts"]["part-000000.parquet"] == {
        "file": "/data/a.parquet", "rows": [0, 20], "num_rows": 20, "error_rows": 2
    }  # fmt: skip
    assert again.data["runs"] == [{"rows": 20}] and again.data["complete"] is False
    (tmp_path / "part-000000.parquet").unlink()  # recorded, but its file is gone: not done
    assert Manifest.open(tmp_path, PARAMS).done() == set()


def test_written_parts_are_in_input_order_and_complete(tmp_path):
    part = Part(3, 0, 40, 45)
    table = write_part(tmp_path, part, [rows(part, [44, 42]), rows(part, [40, 43, 41])])
    assert table.column("id").to_pylist() == [40, 41, 42, 43, 44] and table.column_names == ["id"]
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        write_part(tmp_path, part, [rows(part, [40, 41, 41, 43, 44])])
    assert not list(tmp_path.glob(".part-*"))  # refused before anything was written


def test_a_manifest_of_other_parameters_or_another_tool_is_refused(tmp_path):
    Manifest.open(tmp_path, PARAMS).write()
    with pytest.raises(JobError, match=r"different parameters \(model\)"):
        Manifest.open(tmp_path, PARAMS | {"model": "qwen2.5-vl-7b"})
    with pytest.raises(JobError, match=r"different parameters \(max_image_bytes\)"):  # a parameter the old one lacks
        Manifest.open(tmp_path, PARAMS | {"max_image_bytes": 1000})
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(JobError, match="not a manifest of this tool"):
        Manifest.open(tmp_path, PARAMS)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(JobError, match="unreadable manifest"):
        Manifest.open(tmp_path, PARAMS)


def test_the_lock_refuses_a_second_run_and_removes_half_written_parts(tmp_path):
    (tmp_path / ".part-000001.parquet.tmp-999").write_bytes(b"half")
    with locked(tmp_path):
        assert not list(tmp_path.glob(".part-*"))
        with pytest.raises(JobError, match="another run"):
            with locked(tmp_path):
                pass
    with locked(tmp_path):  # released
        pass


def test_a_part_cut_off_before_its_rename_is_hidden_and_removed_by_the_next_run(tmp_path, monkeypatch):
    """A crash between writing a part and renaming it leaves a temporary that `read_table(DIR)` skips (a hidden
    name) and that the next run's lock removes."""

    def crash(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest_module.os, "replace", crash)
    part = Part(1, 0, 0, 3)
    with pytest.raises(KeyboardInterrupt):
        write_part(tmp_path, part, [rows(part, range(3))])
    monkeypatch.undo()
    (left,) = list(tmp_path.iterdir())
    assert left.name.startswith(".part-000001.parquet.tmp-"), left
    with locked(tmp_path):
        assert [p.name for p in tmp_path.iterdir()] == [".lock"]
