"""The batch job's driver without a Ray cluster: a bad model or input fails before Ray starts (exit 2, one
line), the summary of a no-op re-run, the progress line that counts images, no more GPU actors than batches."""

from __future__ import annotations

import errno
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deployments.batch.__main__ import main
from deployments.batch.files import PART_COLUMN, ROW_COLUMN, InputFile, Part
from deployments.batch.job import JobSummary, PartsRunner, Progress, actors_for
from deployments.batch.manifest import Manifest
from deployments.batch.options import JobConfig


def test_a_bad_model_fails_before_ray_starts(tmp_path, capsys):
    import ray

    connected = ray.is_initialized()  # the full suite's integration tests may have started the session's Ray
    pq.write_table(pa.table({"id": [1], "image": pa.array([b"x"], pa.binary())}), tmp_path / "in.parquet")
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out")]
    assert main([*args, "--model", "/nonexistent/dir"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model '/nonexistent/dir': no such directory"), err
    assert main([*args, "--image-column", "picture"]) == 2
    assert "picture" in capsys.readouterr().err
    # refused before the output directory is opened, and before Ray is connected
    assert ray.is_initialized() == connected and not (tmp_path / "out").exists()


def test_a_no_op_rerun_says_so_instead_of_a_rate():
    summary = JobSummary("/out", total_rows=40, total_parts=1, parts_done=1, complete=True)
    text = summary.text()
    assert "nothing to do, every part was already written" in text and "images/s" not in text
    summary.rows, summary.seconds, summary.arrivals = 40, 4.0, [(4.0, 40)]
    assert "this run: 40 images, 0 error rows, 4.0 s, 10.0 images/s overall (" in summary.text()


def test_progress_counts_images_at_most_every_interval(capsys):
    progress = Progress(100, every_s=5.0)
    for done, seconds in [(10, 1.0), (20, 2.0), (60, 6.5), (100, 7.0)]:
        progress.update(done, seconds)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[deployments.batch] 10/100 images (10%), 10.0 images/s",
        "[deployments.batch] 60/100 images (60%), 9.2 images/s",
        "[deployments.batch] 100/100 images (100%), 14.3 images/s",  # the last one always
    ]
    Progress(5, enabled=False).update(5, 1.0)
    assert capsys.readouterr().err == ""


def test_gpu_actors_are_no_more_than_the_encoder_batches():
    assert actors_for(8, 24, 64) == 1  # one batch: one GPU loads the model, not eight
    assert actors_for(8, 24, 12) == 2
    assert actors_for(8, 24, 11) == 3  # 11 + 11 + 2
    assert actors_for(2, 24, 5) == 2  # five batches, two GPUs
    assert actors_for(0, 24, 64) == 0  # no GPUs: the CPU actors are the pipeline's


def test_rows_per_encoder_batch_are_two_actor_batches_capped_by_images():
    from deployments.batch.model_facts import actor_plan, rows_per_batch

    plan = actor_plan("tiny", "cpu")  # 8192 patches, 32 images per actor batch
    assert rows_per_batch(plan, 256) == 2 * plan.max_batch_patches // 256 == 64
    assert rows_per_batch(plan, 1) == 2 * plan.max_batch_images  # tiny images: the images cap, of two batches
    assert rows_per_batch(plan, 10**9) == 1


def test_a_part_is_written_once_all_its_rows_are_back_then_recorded(tmp_path):
    """`PartsRunner._collect`: nothing is written while rows are missing; then the part's file is renamed into
    place before the manifest records it (a crash in between recomputes the part), with its error rows counted
    and named by id."""
    manifest = Manifest.open(tmp_path, {"model": "tiny"})
    recorded_with_file = []
    record_part = manifest.record_part
    manifest.record_part = lambda part, *a: (
        recorded_with_file.append((tmp_path / part.name).exists()),
        record_part(part, *a),
    )
    files = [InputFile("/data/a.parquet", "parquet", 4, 0, 0, [4])]
    summary = JobSummary(str(tmp_path), total_rows=4, total_parts=1, parts_done=0)
    runner = PartsRunner(JobConfig(input=["x"], output=str(tmp_path)), files, manifest, summary, "id")
    part = Part(0, 0, 0, 4)

    def piece(rows: list[int], errors: list) -> pa.Table:
        return pa.table({"id": [100 + r for r in rows], "error": pa.array(errors, pa.string()),
                         PART_COLUMN: pa.array([0] * len(rows), pa.int32()), ROW_COLUMN: rows})  # fmt: skip

    runner._collect(part, piece([3, 1], [None, "bad"]))
    assert not (tmp_path / part.name).exists() and manifest.data["parts"] == {} and summary.parts_done == 0
    runner._collect(part, piece([0, 2], [None, "also bad"]))
    assert pq.read_table(tmp_path / part.name).column("id").to_pylist() == [100, 101, 102, 103]
    assert recorded_with_file == [True] and manifest.data["parts"][part.name]["error_rows"] == 2
    assert (summary.parts_done, summary.rows, summary.error_rows, summary.error_ids) == (1, 4, 2, [101, 102])
    with pytest.raises(RuntimeError, match="more rows came back than went in"):
        runner._collect(Part(1, 0, 0, 1), piece([0, 0], [None, None]))


def test_a_rerun_does_only_the_parts_not_recorded_and_refuses_another_byte_limit(tmp_path, monkeypatch, capsys):
    """Each run here "finishes" one part (the patched `PartsRunner.run`): the next does only the others, the job
    is complete once all are recorded, a run after that has nothing to do; `--max-image-bytes` decides which rows
    are error rows, so another value is another job."""
    pq.write_table(pa.table({"id": [0, 1, 2], "image": pa.array([b"x"] * 3, pa.binary())}), tmp_path / "in.parquet")
    todos: list[list[str]] = []

    def run(self, todo):
        todos.append([p.name for p in todo])
        (self.manifest.out / todo[0].name).write_bytes(b"")
        self.manifest.record_part(todo[0], "in.parquet", 0)
        self.summary.parts_done += 1

    monkeypatch.setattr(PartsRunner, "run", run)
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--part-rows", "1"]
    assert [main([*args, "--no-progress"]) for _ in range(4)] == [1, 1, 0, 0]
    assert todos == [[f"part-00000{k}.parquet" for k in range(first, 3)] for first in range(3)]
    assert "nothing to do" in capsys.readouterr().out
    assert main([*args, "--no-progress", "--max-image-bytes", "1000"]) == 2
    assert "different parameters (max_image_bytes)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "where, code",
    [("part", errno.ENOSPC), ("manifest", errno.EDQUOT), ("part", errno.EROFS), ("manifest", errno.EACCES)],
)
def test_a_full_disk_ends_the_job_in_one_line_naming_the_path_and_the_cause(tmp_path, monkeypatch, capsys, where, code):
    """A part or the manifest that cannot be written (disk full, quota, read-only, permission): exit 3 with one
    `error:` line naming the file and the cause, no traceback; no temporary is left behind, and a re-run with
    space again completes the job."""
    import deployments.batch.manifest as manifest_module

    pq.write_table(pa.table({"id": [0, 1], "image": pa.array([b"x"] * 2, pa.binary())}), tmp_path / "in.parquet")

    def run(self, todo):  # the rows of each part come back; the driver writes and records them
        for part in todo:
            rows = list(range(part.start, part.stop))
            self._collect(part, pa.table({"id": rows, "error": pa.array([None] * len(rows), pa.string()),
                                          PART_COLUMN: pa.array([part.index] * len(rows), pa.int32()),
                                          ROW_COLUMN: rows}))  # fmt: skip

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(PartsRunner, "run", run)
    target = manifest_module.pq if where == "part" else manifest_module.json
    monkeypatch.setattr(target, "write_table" if where == "part" else "dump", fail)
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(out), "--part-rows", "1", "--no-progress"]
    assert main(args) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    name = "part-000000.parquet" if where == "part" else "_manifest.json"
    assert err[0].startswith(f"error: cannot write {out / name}: {os.strerror(code)}"), err
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    monkeypatch.undo()
    monkeypatch.setattr(PartsRunner, "run", run)
    assert main(args) == 0
