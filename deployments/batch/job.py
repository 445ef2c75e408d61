"""Resumable batch jobs: Parquet / Arrow IPC files in, Parquet parts plus a manifest out.

Layout of the output directory:

    DIR/part-000000.parquet ... one file per part, written to a temporary name, then renamed
    DIR/_manifest.json          the job's parameters and the finished parts (rewritten atomically)
    DIR/.lock                   held (flock) while a run is going; a second run on DIR is refused

Parts are planned from the inputs alone: the input files in sorted order, each cut into row ranges
of `part_rows` rows; part k is always the same rows of the same file. A run reads only the rows of
unfinished parts, streams them through `embed_dataset`, gathers each part's rows on the driver and,
once all of them are back, writes the part (sorted by input row) and records it in the manifest.
A re-run of the same command skips recorded parts; a part whose file was renamed into place but not
yet recorded (crash in between) is simply recomputed and renamed over, so there are no duplicates
and no gaps. A re-run with different parameters (inputs, model, pooling, columns, part size) is
refused rather than mixing results.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from encoder.errors import InvalidArgumentError

from .dataset import (
    ERROR,
    actor_device,
    actor_graph_cap,
    actor_plan,
    check_input_schema,
    config_for,
    deepstack_layers,
    embed_dataset,
    gpus_in_cluster,
    image_column_kind,
    preprocess_config_for,
    resolve_pooling,
    rows_per_batch,
    typical_patches_of,
)

MANIFEST = "_manifest.json"
MANIFEST_FORMAT = "vision-encoding-service/batch-manifest/1"
PART_COLUMN = "_ve_part"  # internal: part index of a row
ROW_COLUMN = "_ve_row"  # internal: row index inside its input file
PARQUET_EXTENSIONS = (".parquet", ".pq")
IPC_EXTENSIONS = (".arrow", ".ipc", ".feather", ".arrows")
# Test hook: exit abruptly (no cleanup) right after the k-th part of this run is renamed into place
# and before the manifest records it, the worst moment for a crash.
CRASH_ENV = "VISION_BATCH_CRASH_AFTER_PARTS"


class JobError(InvalidArgumentError):
    """The job cannot start: bad input, or an output directory that belongs to a different job."""


@dataclass
class JobConfig:
    input: list[str]
    output: str
    image_column: str = "image"
    id_column: str | None = "id"
    model: str = "tiny"
    pooling: str | None = "mean"  # None: the model's default embedding ("model" for CLIP / SigLIP)
    dtype: str | None = None
    attention: str | None = None
    buckets: str | None = None
    batch_size: int | None = None
    part_rows: int | None = None  # default: 10000 rows for mean pooling, 1000 / (1 + DeepStack layers) per token
    decode_batch_size: int = 32
    decode_concurrency: int | None = None
    num_gpus: int | None = None
    num_actors: int | None = None
    progress: bool = True
    address: str | None = None


@dataclass
class InputFile:
    path: str
    format: str  # "parquet" | "ipc-file" | "ipc-stream"
    num_rows: int
    bytes: int
    row_groups: list[int] = field(default_factory=list)  # Parquet: rows per row group


@dataclass
class Part:
    index: int
    file: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"part-{self.index:06d}.parquet"

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass
class JobSummary:
    output: str
    total_rows: int
    total_parts: int
    parts_done: int
    rows: int = 0  # rows embedded by this run
    error_rows: int = 0
    seconds: float = 0.0
    error_ids: list = field(default_factory=list)
    complete: bool = False
    first_batch_seconds: float = 0.0  # start -> first embedded rows back (actor start-up, graph capture)
    arrivals: list = field(default_factory=list, repr=False)  # (seconds, rows back so far) per output batch

    @property
    def images_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_images_per_second(self) -> float:
        """The rate once the pipeline is full: rows back after the first 10% of them, over that time."""
        if not self.arrivals:
            return 0.0
        total = self.arrivals[-1][1]
        t0, r0 = next((t, r) for t, r in self.arrivals if r >= 0.1 * total)
        span = self.arrivals[-1][0] - t0
        return (total - r0) / span if span > 0 else 0.0

    def text(self) -> str:
        state = "complete" if self.complete else "INCOMPLETE (re-run the same command to resume)"
        lines = [
            f"batch job {state}: {self.parts_done}/{self.total_parts} parts, {self.total_rows} rows in the job",
            f"  this run: {self.rows} rows, {self.error_rows} error rows, {self.seconds:.1f} s, "
            f"{self.images_per_second:.1f} images/s overall, {self.steady_images_per_second:.1f} after the first "
            f"10% (first rows back after {self.first_batch_seconds:.1f} s)",
            f"  output: {self.output}",
        ]
        if self.error_ids:
            shown = ", ".join(str(i) for i in self.error_ids[:10])
            more = f" (+{len(self.error_ids) - 10} more)" if len(self.error_ids) > 10 else ""
            lines.insert(2, f"  error rows (id): {shown}{more}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- inputs


def _is_input(path: Path) -> bool:
    name = path.name.lower()
    hidden = name.startswith((".", "_"))
    return not hidden and name.endswith(PARQUET_EXTENSIONS + IPC_EXTENSIONS)


def discover(inputs: list[str]) -> list[Path]:
    """Input files: the given files, and under each directory every Parquet / Arrow file (sorted)."""
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser().resolve()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _is_input(p))
            if not found:
                raise JobError(f"{path}: no Parquet or Arrow IPC files in this directory")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise JobError(f"{raw}: no such file or directory")
    if len(set(files)) != len(files):
        raise JobError("an input file is given twice")
    return files


def _open_ipc(path: Path) -> tuple[str, pa.Table]:
    source = pa.memory_map(str(path), "r")
    try:
        return "ipc-file", pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source = pa.memory_map(str(path), "r")
        return "ipc-stream", pa.ipc.open_stream(source).read_all()


def inspect_input(path: Path) -> tuple[InputFile, pa.Schema]:
    try:
        if path.name.lower().endswith(PARQUET_EXTENSIONS):
            meta = pq.ParquetFile(str(path)).metadata
            groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            info = InputFile(str(path), "parquet", meta.num_rows, path.stat().st_size, groups)
            return info, meta.schema.to_arrow_schema()
        kind, table = _open_ipc(path)  # memory-mapped: zero-copy, only the metadata is read
        return InputFile(str(path), kind, table.num_rows, path.stat().st_size), table.schema
    except (OSError, pa.ArrowException) as exc:
        raise JobError(f"{path}: cannot read as Parquet or Arrow IPC: {exc}") from exc


def plan_parts(files: list[InputFile], part_rows: int) -> list[Part]:
    parts: list[Part] = []
    for f_index, info in enumerate(files):
        for start in range(0, info.num_rows, part_rows):
            parts.append(Part(len(parts), f_index, start, min(start + part_rows, info.num_rows)))
    return parts


# ------------------------------------------------------------------------------------- reading


def read_units(files: list[InputFile], parts: list[Part]) -> list[dict]:
    """Read tasks for the given parts: one per Parquet row group they touch, one per part for IPC.

    A unit lists the (part, start, stop) row ranges it must emit, so a row group shared by a done and
    a pending part is read once and only the pending rows go on.
    """
    by_file: dict[int, list[Part]] = defaultdict(list)
    for part in parts:
        by_file[part.file].append(part)
    units = []
    for f_index, fparts in sorted(by_file.items()):
        info = files[f_index]
        if info.format != "parquet":
            for part in fparts:
                units.append(
                    {
                        "path": info.path,
                        "format": info.format,
                        "group": -1,
                        "group_start": 0,
                        "ranges": [[part.index, part.start, part.stop]],
                    }
                )
            continue
        start = 0
        for g, rows in enumerate(info.row_groups):
            stop = start + rows
            ranges = [
                [p.index, max(p.start, start), min(p.stop, stop)] for p in fparts if p.start < stop and p.stop > start
            ]
            if ranges:
                units.append(
                    {"path": info.path, "format": "parquet", "group": g, "group_start": start, "ranges": ranges}
                )
            start = stop
    return units


def _read_unit(unit: dict) -> pa.Table:
    if unit["format"] == "parquet":
        table = pq.ParquetFile(unit["path"]).read_row_group(unit["group"])
    else:
        table = _open_ipc(Path(unit["path"]))[1]
    pieces = []
    for part, start, stop in unit["ranges"]:
        piece = table.slice(start - unit["group_start"], stop - start)
        piece = piece.append_column(PART_COLUMN, pa.array(np.full(stop - start, part, dtype=np.int32)))
        pieces.append(piece.append_column(ROW_COLUMN, pa.array(np.arange(start, stop, dtype=np.int64))))
    return pa.concat_tables(pieces).combine_chunks()


def read_batch(batch: pa.Table) -> pa.Table:
    """Ray Data map over unit descriptions (JSON strings) -> the rows they stand for."""
    tables = [_read_unit(json.loads(u)) for u in batch.column("unit").to_pylist()]
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]


# ------------------------------------------------------------------------------------- manifest


def job_params(cfg: JobConfig, files: list[InputFile], part_rows: int) -> dict:
    """What determines the output; a re-run must match these exactly."""
    model = str(Path(cfg.model).resolve()) if Path(cfg.model).is_dir() else cfg.model
    return {
        "inputs": [{"path": f.path, "rows": f.num_rows, "bytes": f.bytes} for f in files],
        "image_column": cfg.image_column,
        "model": model,
        "pooling": cfg.pooling,
        "dtype": cfg.dtype,
        "attention": cfg.attention,
        "part_rows": part_rows,
    }


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_manifest(out: Path, params: dict) -> dict:
    path = out / MANIFEST
    if not path.exists():
        return {"format": MANIFEST_FORMAT, "params": params, "parts": {}, "runs": []}
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise JobError(f"{path}: unreadable manifest ({exc}); remove it to start over") from exc
    if manifest.get("format") != MANIFEST_FORMAT:
        raise JobError(f"{path}: not a manifest of this tool")
    old = manifest.get("params", {})
    diffs = [k for k in sorted(set(old) | set(params)) if old.get(k) != params.get(k)]
    if diffs:
        raise JobError(
            f"{out} holds a job with different parameters ({', '.join(diffs)}); use a new --output directory "
            "or delete this one"
        )
    return manifest


@contextlib.contextmanager
def _lock(out: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: no protection against concurrent runs
        yield
        return
    with open(out / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(f"{out}: another run is writing this output directory") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clean_temporaries(out: Path) -> None:
    for tmp in out.glob(".part-*.tmp-*"):
        tmp.unlink(missing_ok=True)


def write_part(out: Path, part: Part, tables: list[pa.Table]) -> pa.Table:
    """Assemble a part's rows (input order), check them, write atomically; returns the written table."""
    table = pa.concat_tables(tables, promote_options="default").sort_by(ROW_COLUMN)
    rows = table.column(ROW_COLUMN).to_numpy()
    if not np.array_equal(rows, np.arange(part.start, part.stop)):
        raise RuntimeError(f"{part.name}: rows out do not match rows in (lost or duplicated rows)")
    table = table.drop_columns([PART_COLUMN, ROW_COLUMN])
    tmp = out / f".{part.name}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, out / part.name)
    return table


# ------------------------------------------------------------------------------------- the job


def _resolve_part_rows(cfg: JobConfig) -> int:
    if cfg.part_rows is not None:
        if cfg.part_rows < 1:
            raise JobError(f"part_rows must be >= 1, got {cfg.part_rows}")
        return cfg.part_rows
    if cfg.pooling != "none":
        return 10_000
    # per-token output, DeepStack layers included: about the same bytes per part whatever the layers
    return max(1, 1_000 // (1 + deepstack_layers(config_for(cfg.model))))


def _sample_typical_patches(cfg: JobConfig, files: list[InputFile], part: Part, size: int = 32) -> int:
    """Median patch count of the first rows of a part's file (image headers only; cheap)."""
    info = files[part.file]
    if info.format == "parquet":
        pf = pq.ParquetFile(info.path)
        kind = image_column_kind(pf.schema_arrow.field(cfg.image_column).type)
        first = next(pf.iter_batches(batch_size=size, columns=[cfg.image_column]), None)
        values = first.column(0).to_pylist() if first is not None else []
    else:
        table = _open_ipc(Path(info.path))[1]
        kind = image_column_kind(table.schema.field(cfg.image_column).type)
        values = table.column(cfg.image_column).slice(0, size).to_pylist()
    return typical_patches_of(values, kind, preprocess_config_for(cfg.model), str(Path.cwd()))


def run_job(cfg: JobConfig) -> JobSummary:
    """Run (or resume) a batch job; returns its summary (also printed)."""
    try:  # a bad model name or pooling fails here, before anything starts
        cfg = replace(cfg, pooling=resolve_pooling(cfg.pooling, cfg.model))
    except InvalidArgumentError as exc:
        raise JobError(str(exc)) from None
    preprocess_config_for(cfg.model)
    out = Path(cfg.output).expanduser().resolve()
    paths = [p for p in discover(cfg.input) if out not in p.parents]  # never our own parts as input
    if not paths:
        raise JobError("no input files (the output directory's own parts are not inputs)")
    infos, schemas = zip(*(inspect_input(p) for p in paths), strict=True)
    files = list(infos)
    for path, schema in zip(paths, schemas, strict=True):
        try:
            check_input_schema(schema, cfg.image_column)
        except InvalidArgumentError as exc:
            raise JobError(f"{path}: {exc}") from None
        if set(schema.names) & {PART_COLUMN, ROW_COLUMN}:
            raise JobError(f"{path}: columns {PART_COLUMN}/{ROW_COLUMN} are reserved")
    id_column = cfg.id_column if cfg.id_column and cfg.id_column in schemas[0].names else None
    if cfg.id_column and id_column is None and cfg.id_column != "id":
        raise JobError(f"no id column {cfg.id_column!r} in the input; columns: {', '.join(schemas[0].names)}")
    part_rows = _resolve_part_rows(cfg)
    parts = plan_parts(files, part_rows)
    out.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        _clean_temporaries(out)
        manifest = load_manifest(out, job_params(cfg, files, part_rows))
        done = {name for name in manifest["parts"] if (out / name).exists()}
        todo = [p for p in parts if p.name not in done]
        summary = JobSummary(str(out), sum(f.num_rows for f in files), len(parts), len(done))
        if todo:
            _run_parts(cfg, files, todo, out, manifest, summary, id_column)
        summary.complete = summary.parts_done == summary.total_parts
        manifest["complete"] = summary.complete
        _write_json_atomic(out / MANIFEST, manifest)
    print(summary.text(), flush=True)
    return summary


def _run_parts(cfg, files, todo, out, manifest, summary, id_column) -> None:
    import ray
    import ray.data

    if not ray.is_initialized():
        ray.init(address=cfg.address)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = cfg.progress
    gpus = gpus_in_cluster() if cfg.num_gpus is None else cfg.num_gpus
    batch_size = cfg.batch_size
    if batch_size is None:
        typical = _sample_typical_patches(cfg, files, todo[0])
        device = actor_device(gpus)
        plan = actor_plan(cfg.model, device, cfg.buckets, actor_graph_cap(cfg.model, device, cfg.dtype, cfg.attention))
        batch_size = rows_per_batch(plan, typical)
    units = read_units(files, todo)
    ds = ray.data.from_items([{"unit": json.dumps(u)} for u in units], override_num_blocks=len(units))
    ds = ds.map_batches(read_batch, batch_format="pyarrow", batch_size=None, udf_modifying_row_count=True)
    ds = embed_dataset(
        ds,
        model=cfg.model,
        image_column=cfg.image_column,
        pooling=cfg.pooling,
        batch_size=batch_size,
        num_gpus=gpus,
        num_actors=cfg.num_actors,
        buckets=cfg.buckets,
        dtype=cfg.dtype,
        attention=cfg.attention,
        decode_batch_size=cfg.decode_batch_size,
        decode_concurrency=cfg.decode_concurrency,
    )
    by_index = {p.index: p for p in todo}
    pending: dict[int, list[pa.Table]] = defaultdict(list)
    received: dict[int, int] = defaultdict(int)
    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    written: set[int] = set()
    print(
        f"[deployments.batch] {len(todo)} of {summary.total_parts} parts to do "
        f"({sum(p.num_rows for p in todo)} rows), {batch_size} rows per encoder batch, "
        f"{f'{gpus} GPU actor(s)' if gpus else 'CPU'}",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
            now = time.perf_counter() - start
            if not summary.arrivals:
                summary.first_batch_seconds = now
            summary.arrivals.append((now, batch.num_rows + (summary.arrivals[-1][1] if summary.arrivals else 0)))
            part_ids = batch.column(PART_COLUMN).to_numpy()
            for pid in np.unique(part_ids):
                part = by_index[int(pid)]
                piece = batch.filter(pa.array(part_ids == pid))
                pending[part.index].append(piece)
                received[part.index] += piece.num_rows
                if received[part.index] > part.num_rows:
                    raise RuntimeError(f"{part.name}: more rows came back than went in")
                if received[part.index] < part.num_rows:
                    continue
                table = write_part(out, part, pending.pop(part.index))
                written.add(part.index)
                if crash_after and len(written) >= crash_after:
                    os._exit(75)
                errors = table.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
                n_err = int(errors.sum())
                if id_column:
                    summary.error_ids.extend(table.column(id_column).filter(pa.array(errors)).to_pylist())
                manifest["parts"][part.name] = {
                    "file": files[part.file].path,
                    "rows": [part.start, part.stop],
                    "num_rows": part.num_rows,
                    "error_rows": n_err,
                }
                _write_json_atomic(out / MANIFEST, manifest)
                summary.parts_done += 1
                summary.rows += part.num_rows
                summary.error_rows += n_err
    except KeyboardInterrupt:
        print("[deployments.batch] interrupted; finished parts are kept, re-run to resume", file=sys.stderr)
        raise
    finally:
        summary.seconds = time.perf_counter() - start
        manifest["runs"].append(
            {
                **asdict(cfg),
                "batch_size": batch_size,
                "rows": summary.rows,
                "error_rows": summary.error_rows,
                "seconds": round(summary.seconds, 3),
            }
        )
        _write_json_atomic(out / MANIFEST, manifest)
    missing = sorted(set(by_index) - written)
    if missing:
        raise RuntimeError(f"parts {missing} did not get all their rows back")
