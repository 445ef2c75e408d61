"""What the batch job's driver checks of its inputs before Ray starts (no Ray, no model): files against each
other, the id column, hidden directories, inputs rewritten between a run and its resume, and GPUs that its own
Ray instance cannot have. Each refusal is exit status 2 with one line naming the file."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deployments import ray_compat
from deployments.batch import job as job_module
from deployments.batch.__main__ import main
from deployments.batch.files import InputFile, JobError, discover, inspect_input
from deployments.batch.job import PartsRunner, job_params
from deployments.batch.manifest import Manifest
from deployments.batch.options import JobConfig
from tests.images_util import encode, random_image


def png(seed: int) -> bytes:
    return encode(random_image("RGB", 32, 40, seed=seed), "PNG")


def refused(args: list[str], capsys) -> str:
    """Run the CLI; it must exit 2 with one `error:` line, which is returned."""
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "object at 0x" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "second, says",
    [
        # broken: Ray Data's "Failed to unify schemas" traceback at run time, at every re-run
        ({"id": pa.array(["3", "4"]), "image": [png(3), png(4)]}, "its columns do not fit those of"),
        # broken: exit 0, the paths decoded as image bytes, every row an error row
        ({"id": [3, 4], "image": ["a.png", "b.png"]}, "holds file paths but in"),
        # broken: the summary's `error rows (id): None`
        ({"name": ["3", "4"], "image": [png(3), png(4)]}, "no id column 'id' (the other inputs have it)"),
    ],
)
def test_input_files_that_do_not_fit_each_other_are_refused(second, says, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [0, 1, 2], "image": [png(i) for i in range(3)]}), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table(second), tmp_path / "in" / "b.parquet")
    line = refused(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")], capsys)
    assert str(tmp_path / "in" / "b.parquet") in line and says in line, line
    assert not (tmp_path / "out").exists()  # before the output directory, and so before Ray


def test_files_whose_columns_unify_are_accepted_together(tmp_path):
    """int32 beside int64 ids, binary beside large_binary images, a column only one file has: Ray Data unifies
    these, so the check lets them through."""
    a = pa.table({"id": pa.array([0, 1], pa.int32()), "image": pa.array([png(0), png(1)], pa.binary())})
    b = pa.table({"id": [2, 3], "image": pa.array([png(2), png(3)], pa.large_binary()), "caption": ["x", "y"]})
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    for table, path in zip([a, b], paths, strict=True):
        pq.write_table(table, path)
    schemas = [inspect_input(p)[1] for p in paths]
    cfg = JobConfig(input=[str(tmp_path)], output=str(tmp_path / "out"))
    assert job_module.check_inputs(paths, schemas, cfg) == "id"


def test_the_image_column_as_the_id_column_is_refused(tmp_path, capsys):
    """Broken: every finished part raised KeyError (the output drops the image column), at every re-run."""
    pq.write_table(pa.table({"image": ["a.png", "b.png"]}), tmp_path / "in.parquet")
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--id-column", "image"]
    assert "--id-column 'image' is the image column" in refused(args, capsys)


@pytest.mark.parametrize(
    "option, says",
    [(["--dtype", "float64x"], "dtype 'float64x'"), (["--attention", "nope"], "attention 'nope'"),
     (["--buckets", "garbage"], "buckets 'garbage'"), (["--buckets", "7"], "multiple of")],
)  # fmt: skip
def test_a_bad_actor_option_is_refused_before_ray_starts(option, says, tmp_path, capsys):
    """Broken: refused only once Ray had started (~10 s), leaving an output directory holding a lock file."""
    pq.write_table(pa.table({"id": [0], "image": [png(0)]}), tmp_path / "in.parquet")
    line = refused(["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), *option], capsys)
    assert says in line, line
    assert not (tmp_path / "out").exists()


def test_a_rewritten_input_is_refused_on_resume(tmp_path, capsys):
    """Broken: the same size and row count passed for the same input, and a resume over shuffled rows wrote some
    ids twice and lost others, exit 0."""
    path, out = tmp_path / "in.arrow", tmp_path / "out"
    table = pa.table({"id": list(range(40)), "image": [png(i % 4) for i in range(40)]})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    cfg = JobConfig(input=[str(path)], output=str(out), part_rows=10, pooling="mean")  # as run_job resolves it
    out.mkdir()
    Manifest.open(out, job_params(cfg, [inspect_input(path)[0]], 10)).write()  # a first run, killed after it began
    before = path.stat()
    shuffled = table.take(pa.array(list(range(39, -1, -1))))
    with pa.ipc.new_file(str(path), shuffled.schema) as writer:
        writer.write_table(shuffled)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))  # a later write, whatever the clock
    assert path.stat().st_size == before.st_size  # what the manifest compared before
    line = refused(["--input", str(path), "--output", str(out), "--part-rows", "10"], capsys)
    assert f"different parameters (inputs: {path} was rewritten since the job started)" in line, line


def test_files_under_hidden_directories_are_not_inputs(tmp_path):
    """`.cache/` or Spark's in-progress `_temporary/` are skipped as pyarrow's datasets skip them; the directory
    given may itself have such a name."""
    root = tmp_path / "_data"
    for rel in ["a.parquet", "sub/b.parquet", ".cache/c.parquet", "_temporary/0/d.parquet", "_SUCCESS", ".e.pq"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    assert discover([str(root)]) == [root / "a.parquet", root / "sub" / "b.parquet"]


def test_gpus_its_own_ray_cannot_have_are_refused_instead_of_waited_for(monkeypatch, tmp_path):
    """Broken: `--num-gpus 1` on a machine without one waited forever for a GPU actor, saying nothing."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(job_module, "ray_address", lambda given: "local" if given is None else given)
    monkeypatch.setattr(job_module, "start_reaper", lambda: None)
    monkeypatch.setattr(ray_compat, "quiet_token_auth_notice", lambda: None)  # a process-wide log filter
    monkeypatch.setattr(job_module, "gpus_in_cluster", lambda: 0)
    cfg = JobConfig(input=["x"], output=str(tmp_path), num_gpus=1)
    with pytest.raises(JobError, match=r"--num-gpus 1: this machine has 0 GPU\(s\) for Ray"):
        PartsRunner(cfg, [], None, None, None)._options([], 10)
    assert calls == [{"address": "local"}]
    # a cluster of someone else's may still add GPU nodes (an autoscaler): not refused here
    cluster = cfg.model_copy(update={"address": "ray://head:10001", "batch_size": 8})
    options, gpus = PartsRunner(cluster, [], None, None, None)._options([], 10)
    assert gpus == 1 and options.num_gpus == 1


def test_embed_dataset_defaults_to_the_pooling_of_the_cli_and_the_service():
    """Broken: `embed_dataset(ds, model="tiny-clip")` gave the mean of the tokens where the CLI and the HTTP API
    give CLIP's own image embedding."""
    from deployments.batch.__main__ import parse_args
    from deployments.batch.model_facts import resolve_pooling
    from deployments.batch.options import EmbedOptions

    for model, own in (("tiny", "mean"), ("tiny-clip", "model"), ("tiny-siglip2", "model")):
        cli = parse_args(["--input", "x", "--output", "y", "--model", model]).pooling
        assert resolve_pooling(EmbedOptions.of(model=model).pooling, model) == resolve_pooling(cli, model) == own


def test_an_output_directory_holding_an_input_is_refused(tmp_path, capsys):
    """Broken: `--output` the input's own directory said "no input files (the output directory's own parts are not
    inputs)"; and an output directory beside its inputs would be read with them by `read_table(DIR)`."""
    pq.write_table(pa.table({"id": [0], "image": [png(0)]}), tmp_path / "in.parquet")
    line = refused(["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path)], capsys)
    assert f"--output {tmp_path}: holds the input {tmp_path / 'in.parquet'}" in line, line


class _SchemaOnly:
    """A dataset whose schema is known without running anything (as `ray.data.read_parquet`'s is), given as Ray
    Data gives it (`ray.data.Schema`, which is no pyarrow schema: the first fix called `.field` on it); anything
    beyond `schema()` means `embed_dataset` went on past its checks."""

    def __init__(self, schema: pa.Schema):
        import ray.data

        self._schema = ray.data.Schema(schema)

    def schema(self, fetch_if_missing: bool = True):
        return self._schema

    def __getattr__(self, name):
        raise AssertionError(f"embed_dataset used ds.{name} before refusing the input")


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (pa.schema([("id", pa.int64()), ("image", pa.int64())]), "image column has type int64; expected binary"),
        (pa.schema([("image", pa.binary()), ("embedding", pa.string())]), "input column(s) embedding would be"),
        (pa.schema([("image", pa.binary()), ("_ve_pixels", pa.binary())]), "input column(s) _ve_pixels would be"),
        (pa.schema([("picture", pa.binary())]), "no column 'image' in the input; columns: picture"),
    ],
)
def test_embed_dataset_refuses_a_bad_schema_before_any_work(schema, message):
    """Broken: `embed_dataset` checked only that the image column existed. An int column failed in every decode
    task once the job ran; an input column named `embedding` or `error` was silently overwritten by the output
    (the CLI refused both before Ray started)."""
    from deployments.batch import embed_dataset
    from deployments.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as refusal:
        embed_dataset(_SchemaOnly(schema), model="tiny", num_gpus=0)
    assert message in str(refusal.value), refusal.value


def test_a_resume_from_another_directory_resolves_relative_paths_as_the_first_run_did(tmp_path, monkeypatch):
    """Broken: relative image paths resolved against each run's working directory, so a resume started elsewhere
    read other files (or none: every row an error) for the parts still to do, beside parts written from the
    first directory's images."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    (first / "a.png").write_bytes(png(1))
    pq.write_table(pa.table({"id": [0], "image": ["a.png"]}), tmp_path / "in.parquet")
    roots: list[str | None] = []
    monkeypatch.setattr(PartsRunner, "run", lambda self, todo: roots.append(self.cfg.path_root))
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--no-progress"]
    for cwd in (first, elsewhere):  # the patched run writes no part: the second run resumes the job
        monkeypatch.chdir(cwd)
        main(args)
    assert roots == [str(first), str(first)]
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["path_root"] == str(first)


def test_an_input_holding_the_jobs_internal_row_columns_is_refused():
    """The job tags rows with `_ve_part` / `_ve_row` and writes parts sorted by them: an input column of that name
    would be overwritten, or order and check a part by the input's values."""
    good = pa.schema([("id", pa.int64()), ("image", pa.binary())])
    cfg = JobConfig(input=["in"], output="out")
    for column in ("_ve_part", "_ve_row"):
        clash = good.append(pa.field(column, pa.int64()))
        with pytest.raises(JobError, match=r"^b\.parquet: columns _ve_part/_ve_row are reserved"):
            job_module.check_inputs([Path("a.parquet"), Path("b.parquet")], [good, clash], cfg)


class _Recorded:
    """A dataset that records the stages `embed_dataset` adds (no Ray Data work)."""

    def __init__(self, schema: pa.Schema):
        import ray.data

        self._schema, self.calls = ray.data.Schema(schema), []

    def schema(self, fetch_if_missing: bool = True):
        return self._schema

    def repartition(self, **kwargs):
        return self

    def map_batches(self, fn, **kwargs):
        self.calls.append((fn, kwargs))
        return self


def test_embed_dataset_decodes_relative_paths_under_its_path_root(tmp_path, monkeypatch):
    """A job's resume reads relative image paths under the manifest's `path_root`, whatever its working directory:
    `embed_dataset` must hand that root (and the byte limit) to its decode tasks."""
    from deployments.batch import decode_batch, embed_dataset

    monkeypatch.chdir(tmp_path)
    for given, root in ((None, str(tmp_path)), ("/first/run", "/first/run")):
        ds = _Recorded(pa.schema([("id", pa.int64()), ("image", pa.string())]))
        embed_dataset(ds, model="tiny", num_gpus=0, batch_size=4, path_root=given, max_image_bytes=123)
        (kwargs,) = [kw for fn, kw in ds.calls if fn is decode_batch]
        assert kwargs["fn_kwargs"]["path_root"] == root and kwargs["fn_kwargs"]["max_image_bytes"] == 123


@pytest.mark.parametrize("changed", [{"bytes": 1001}, {"num_rows": 41}, {"mtime_ns": 8}])
def test_an_input_changed_in_size_rows_or_mtime_is_refused_on_resume(changed, tmp_path):
    """Any of size, rows and modification time tells a rewritten input (`cp -p` or `rsync -t` keep the mtime)."""
    cfg = JobConfig(input=["in"], output=str(tmp_path), pooling="mean")
    first = InputFile("/data/a.parquet", "parquet", 40, 1000, 7, [40])
    Manifest.open(tmp_path, job_params(cfg, [first], 10)).write()
    with pytest.raises(JobError, match=r"\(inputs: /data/a\.parquet was rewritten since the job started\)"):
        Manifest.open(tmp_path, job_params(cfg, [replace(first, **changed)], 10))
