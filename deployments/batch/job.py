"""Resumable batch jobs: Parquet / Arrow IPC files in, Parquet parts plus a manifest out.

`run_job(JobConfig(...))` checks the inputs, plans the parts (`deployments.batch.files`), opens the output
directory (`deployments.batch.manifest`: lock, manifest, part files) and hands the unfinished parts to a
`PartsRunner`: it streams their rows through `embed_dataset`, gathers each part's rows on the driver and,
once all of them are back, writes the part (sorted by input row) and records it in the manifest. A re-run
of the same command skips recorded parts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from deployments.batch.columns import ERROR, VIDEO_COLUMNS
from deployments.batch.decode import check_input_schema, image_column_kind, typical_patches_of
from deployments.batch.files import (
    PART_COLUMN,
    ROW_COLUMN,
    InputFile,
    JobError,
    Part,
    discover,
    head_values,
    inspect_input,
    plan_parts,
    read_batch,
    read_units,
)
from deployments.batch.manifest import Manifest, locked, write_part
from deployments.batch.model_facts import (
    check_actor_options,
    config_for,
    deepstack_layers,
    gpus_in_cluster,
    plan_for_actors,
    preprocess_config_for,
    resolve_pooling,
    rows_per_batch,
    typical_video_patches,
    video_config_for,
)
from deployments.batch.options import JobConfig
from deployments.batch.pipeline import embed_dataset
from deployments.batch.reaper import start_reaper
from deployments.batch.texts import check_text_model, check_text_schema, text_pooling, text_rows_per_batch
from deployments.preflight import ray_address
from deployments.vllm_handoff import check_vllm_model
from encoder.errors import InvalidArgumentError, RandomWeightsWarning

# Test hook: exit abruptly (no cleanup) right after the k-th part of this run is renamed into place
# and before the manifest records it, the worst moment for a crash.
CRASH_ENV = "VISION_BATCH_CRASH_AFTER_PARTS"


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
    unit: str = "images"  # what a row holds: "images", or "texts" for a text job
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
        if self.rows:
            steady = self.steady_images_per_second
            rates = f"{self.images_per_second:.1f} {self.unit}/s overall" + (
                f", {steady:.1f} after the first 10%" if steady else ""
            )
            this_run = (
                f"  this run: {self.rows} {self.unit}, {self.error_rows} error rows, {self.seconds:.1f} s, {rates} "
                f"(first rows back after {self.first_batch_seconds:.1f} s)"
            )
        else:  # a re-run of a finished job: no rate to report
            this_run = "  this run: nothing to do, every part was already written"
        lines = [
            f"batch job {state}: {self.parts_done}/{self.total_parts} parts, {self.total_rows} rows in the job",
            this_run,
            f"  output: {self.output}",
        ]
        if self.error_ids:
            shown = ", ".join(str(i) for i in self.error_ids[:10])
            more = f" (+{len(self.error_ids) - 10} more)" if len(self.error_ids) > 10 else ""
            lines.insert(2, f"  error rows (id): {shown}{more}")
        return "\n".join(lines)


PART_NAME = re.compile(r"part-\d{6}\.parquet")  # what `files.Part.name` writes


def job_params(cfg: JobConfig, files: list[InputFile], part_rows: int) -> dict:
    """What determines the output; a re-run must match these exactly."""
    model = str(Path(cfg.model).resolve()) if Path(cfg.model).is_dir() else cfg.model
    return {
        "inputs": [{"path": f.path, "rows": f.num_rows, "bytes": f.bytes, "mtime_ns": f.mtime_ns} for f in files],
        "image_column": cfg.image_column,
        # only when set, as quantization below
        **({"text_column": cfg.text_column} if cfg.text_column else {}),
        **({"video_column": cfg.video_column} if cfg.video_column else {}),
        # the columns a video job's per-token outputs add: a job begun before they were written is not resumed into
        # parts of two schemas
        **({"video_columns": list(VIDEO_COLUMNS)} if cfg.video_column and (cfg.pooling == "none" or cfg.vllm) else {}),
        "model": model,
        "pooling": cfg.pooling,
        "dtype": cfg.dtype,
        "attention": cfg.attention,
        # only when set: the manifests of jobs run before the option existed keep matching their re-runs
        **({"quantization": cfg.quantization} if cfg.quantization else {}),
        **({"layout": cfg.layout} if cfg.layout != "parts" else {}),
        **({"ec_cache_dir": cfg.ec_cache_dir, "uuid_column": cfg.uuid_column} if cfg.ec_cache_dir else {}),
        "part_rows": part_rows,
        "max_image_bytes": cfg.max_image_bytes,  # which rows are error rows
    }


def check_inputs(paths: list[Path], schemas: list[pa.Schema], cfg: JobConfig) -> str | None:
    """Check each input file, and the files against each other (Ray Data mixes their rows in its blocks: a
    column of other types in another file fails the whole job at run time, and a file of paths beside one
    of bytes would be decoded as bytes); returns the id column, or None for none. JobError names the file."""
    if cfg.text_column is not None:
        return check_text_inputs(paths, schemas, cfg)
    for path, schema in zip(paths, schemas, strict=True):
        try:
            check_input_schema(schema, cfg.image_column, video=cfg.video_column is not None)
        except InvalidArgumentError as exc:
            raise JobError(f"{path}: {exc}") from None
        if cfg.uuid_column is not None:
            field = schema.field(cfg.uuid_column) if cfg.uuid_column in schema.names else None
            if field is None or not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
                raise JobError(f"{path}: --uuid-column {cfg.uuid_column!r} must be a string column of the input")
        if set(schema.names) & {PART_COLUMN, ROW_COLUMN}:
            raise JobError(f"{path}: columns {PART_COLUMN}/{ROW_COLUMN} are reserved")
    kinds = [image_column_kind(s.field(cfg.image_column).type) for s in schemas]
    for path, kind in zip(paths, kinds, strict=True):
        if kind != kinds[0]:
            held = {"bytes": "encoded images", "path": "file paths", "struct": "Hugging Face Image structs"}
            raise JobError(
                f"{path}: column {cfg.image_column!r} holds {held[kind]} but in {paths[0]} it holds "
                f"{held[kinds[0]]}; run one job per kind"
            )
    return fitting_id_column(paths, schemas, cfg, cfg.image_column, "image")


def check_text_inputs(paths: list[Path], schemas: list[pa.Schema], cfg: JobConfig) -> str | None:
    """`check_inputs` of a text job: the text column in every file, a string column; the id column as for images."""
    for path, schema in zip(paths, schemas, strict=True):
        try:
            check_text_schema(schema, cfg.text_column)
        except InvalidArgumentError as exc:
            raise JobError(f"{path}: {exc}") from None
        if set(schema.names) & {PART_COLUMN, ROW_COLUMN}:
            raise JobError(f"{path}: columns {PART_COLUMN}/{ROW_COLUMN} are reserved")
    return fitting_id_column(paths, schemas, cfg, cfg.text_column, "text")


def fitting_id_column(paths: list[Path], schemas: list[pa.Schema], cfg: JobConfig, item_column: str, what: str):
    """The files' columns unified (Ray Data mixes their rows in blocks), then the id column: in every file, and not
    the `what` column `item_column`, which the output does not keep; None for none. JobError names the file."""
    for path, schema in zip(paths, schemas, strict=True):
        try:
            pa.unify_schemas([schemas[0], schema], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, NotImplementedError) as exc:
            raise JobError(f"{path}: its columns do not fit those of {paths[0]} ({exc})") from None
    id_column = cfg.id_column if cfg.id_column and cfg.id_column in schemas[0].names else None
    if cfg.id_column and id_column is None and cfg.id_column != "id":
        raise JobError(f"no id column {cfg.id_column!r} in the input; columns: {', '.join(schemas[0].names)}")
    if id_column == item_column:  # the output keeps every input column but that one
        raise JobError(
            f"--id-column {id_column!r} is the {what} column, which the output does not keep; name another column"
        )
    for path, schema in zip(paths, schemas, strict=True):
        if id_column is not None and id_column not in schema.names:
            raise JobError(f"{path}: no id column {id_column!r} (the other inputs have it)")
    return id_column


def resolve_part_rows(cfg: JobConfig) -> int:
    if cfg.part_rows is not None:
        return cfg.part_rows
    if cfg.pooling != "none" and not cfg.vllm:
        return 10_000
    if cfg.ec_cache_dir is not None:  # the tensors go to their own files: a row is a path and a grid
        return 10_000
    # per-token output, DeepStack layers included: about the same bytes per part whatever the layers
    return max(1, 1_000 // (1 + deepstack_layers(config_for(cfg.model))))


def make_output_dir(out: Path) -> None:
    """Create the output directory (JobError naming it, and why, when it cannot be created or written)."""
    if out.exists() and not out.is_dir():
        raise JobError(f"--output {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"--output {out}: cannot create the directory: {e.strerror or e}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise JobError(f"--output {out}: the directory is not writable")


def run_job(cfg: JobConfig) -> JobSummary:
    """Run (or resume) a batch job; returns its summary (also printed)."""
    try:  # a bad model name or pooling (a model without text, for a text job) fails here, before anything starts
        if cfg.text_column is not None:
            check_text_model(cfg.model)
            cfg = cfg.model_copy(update={"pooling": text_pooling(cfg.pooling)})
        else:
            if cfg.vllm:  # Qwen towers only; the per-token outputs
                check_vllm_model(config_for(cfg.model).family, cfg.model, "--layout")
            if cfg.video_column is not None:  # a tower without video: refused here, before Ray starts
                video_config_for(cfg.model)
            pooling = resolve_pooling("none" if cfg.vllm else cfg.pooling, cfg.model)
            cfg = cfg.model_copy(update={"pooling": pooling})
            if cfg.ec_cache_dir is not None:  # the actors may run elsewhere: an absolute path
                cfg = cfg.model_copy(update={"ec_cache_dir": str(Path(cfg.ec_cache_dir).expanduser().resolve())})
    except InvalidArgumentError as exc:
        raise JobError(str(exc)) from None
    preprocess_config_for(cfg.model)
    out = Path(cfg.output).expanduser().resolve()
    paths = [p for p in discover(cfg.input) if not (p.parent == out and PART_NAME.fullmatch(p.name))]
    if not paths:
        raise JobError("no input files (the output directory's own parts are not inputs)")
    inside = [p for p in paths if out in p.parents]
    if inside:  # `pyarrow.parquet.read_table(out)` would read it with the parts
        raise JobError(f"--output {out}: holds the input {inside[0]}; give the output a directory of its own")
    infos, schemas = zip(*(inspect_input(p) for p in paths), strict=True)
    files = list(infos)
    id_column = check_inputs(paths, list(schemas), cfg)
    check_actor_options(cfg.model, cfg.buckets, cfg.dtype, cfg.attention)
    part_rows = resolve_part_rows(cfg)
    parts = plan_parts(files, part_rows)
    make_output_dir(out)
    with locked(out):
        manifest = Manifest.open(out, job_params(cfg, files, part_rows))
        cfg = cfg.model_copy(update={"path_root": manifest.path_root(str(Path(cfg.path_root or ".").resolve()))})
        done = manifest.done()
        todo = [p for p in parts if p.name not in done]
        summary = JobSummary(str(out), sum(f.num_rows for f in files), len(parts), len(done))
        summary.unit = "texts" if cfg.text_column else "images"
        if todo:
            PartsRunner(cfg, files, manifest, summary, id_column).run(todo)
        summary.complete = summary.parts_done == summary.total_parts
        manifest.finish(summary.complete)
    print(summary.text(), flush=True)
    return summary


class Progress:
    """`[deployments.batch] 1200/5000 images (24%), 310.5 images/s` on stderr, at most every `every_s` and
    once at the end."""

    def __init__(self, total: int, enabled: bool = True, every_s: float = 5.0, unit: str = "images"):
        self.total, self.enabled, self.every_s, self._last = total, enabled, every_s, float("-inf")
        self.unit = unit

    def update(self, done: int, seconds: float) -> None:
        if not self.enabled or (done < self.total and seconds - self._last < self.every_s):
            return
        self._last = seconds
        rate = done / seconds if seconds > 0 else 0.0
        print(
            f"[deployments.batch] {done}/{self.total} {self.unit} ({100 * done // max(1, self.total)}%), "
            f"{rate:.1f} {self.unit}/s",
            file=sys.stderr,
            flush=True,
        )


def actors_for(wanted: int, rows: int, batch_size: int) -> int:
    """Encoder actors for `rows` rows to do: `wanted` (one per GPU, or `--num-actors` on CPUs), but no more than
    there are encoder batches. Each actor loads the model and captures its graphs before its first batch, so
    a small job (or a re-run with little left) does not hold GPUs that no batch would reach; Ray Data would
    also warn that the pool outnumbers its inputs."""
    return min(wanted, max(1, -(-rows // batch_size)))


class PartsRunner:
    """Embeds the given parts of a job and writes each one as soon as all its rows are back."""

    def __init__(self, cfg: JobConfig, files: list[InputFile], manifest: Manifest, summary, id_column):
        self.cfg, self.files, self.manifest, self.summary, self.id_column = cfg, files, manifest, summary, id_column
        self._pending: dict[int, list[pa.Table]] = defaultdict(list)
        self._received: dict[int, int] = defaultdict(int)
        self._written: set[int] = set()
        self._crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)

    def _options(self, todo: list[Part], rows: int) -> tuple[JobConfig, int]:
        """The job's options with its encoder actors and the rows per encoder batch decided, and the GPUs it may
        use (the GPU actors may be fewer: `actors_for`)."""
        import ray

        from deployments.ray_compat import quiet_token_auth_notice

        cfg, own_ray = self.cfg, False
        if not ray.is_initialized():
            address = ray_address(cfg.address)
            own_ray = address == "local"
            if own_ray:  # a Ray instance of this process's own: ended with it, even on SIGKILL
                start_reaper()
            quiet_token_auth_notice()  # authentication stays on; Ray's notice of it at every start goes
            ray.init(address=address)
        available = gpus_in_cluster()
        if cfg.num_gpus and own_ray and available < cfg.num_gpus:  # nothing could add GPUs: it would wait forever
            raise JobError(
                f"--num-gpus {cfg.num_gpus}: this machine has {available} GPU(s) for Ray (the job's own instance); "
                "ask for fewer, or pass --address of a cluster that has them"
            )
        gpus = available if cfg.num_gpus is None else cfg.num_gpus
        batch_size = cfg.batch_size
        if batch_size is None and cfg.text_column is not None:
            batch_size = text_rows_per_batch()
        if batch_size is None:
            if cfg.video_column is not None:  # no header tells a video's sampled size: the processor's budget
                typical = cfg.typical_patches or typical_video_patches(video_config_for(cfg.model))
            else:
                values, typ = head_values(self.files[todo[0].file], cfg.image_column)
                pp = preprocess_config_for(cfg.model)
                typical = typical_patches_of(values, image_column_kind(typ), pp, cfg.path_root)
            plan = plan_for_actors(cfg.model, gpus, cfg.buckets, cfg.dtype, cfg.attention)
            batch_size = rows_per_batch(plan, typical)
        actors = {"num_gpus": actors_for(gpus, rows, batch_size)}
        if cfg.num_actors is not None:
            actors["num_actors"] = actors_for(cfg.num_actors, rows, batch_size)
        return cfg.model_copy(update={**actors, "batch_size": batch_size}), gpus

    def run(self, todo: list[Part]) -> None:
        import ray.data

        rows = sum(p.num_rows for p in todo)
        options, gpus_usable = self._options(todo, rows)
        # Ray Data's bars count blocks per operator (`MapBatches(decode_batch): 53/26`); the job counts images.
        # Its logger would then warn, once per process, that the bars are off.
        ray.data.DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
        units = read_units(self.files, todo)
        ds = ray.data.from_items([{"unit": json.dumps(u)} for u in units], override_num_blocks=len(units))
        ds = ds.map_batches(read_batch, batch_format="pyarrow", batch_size=None, udf_modifying_row_count=True)
        with warnings.catch_warnings(record=True) as caught:  # the job's driver says each in one plain line
            warnings.simplefilter("always", RandomWeightsWarning)
            ds = embed_dataset(ds, options)
        for w in caught:
            print(f"[deployments.batch] warning: {w.message}", file=sys.stderr, flush=True)
        by_index = {p.index: p for p in todo}
        gpus, summary = options.num_gpus, self.summary
        capped = f" (one per encoder batch; {gpus_usable} GPUs)" if gpus < gpus_usable else ""
        print(
            f"[deployments.batch] {len(todo)} of {summary.total_parts} parts to do "
            f"({rows} rows), {options.batch_size} rows per encoder batch, "
            f"{f'{gpus} GPU actor(s){capped}' if gpus else 'CPU'}",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        progress = Progress(rows, enabled=options.progress, unit=summary.unit)
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
                now = time.perf_counter() - start
                if not summary.arrivals:
                    summary.first_batch_seconds = now
                summary.arrivals.append((now, batch.num_rows + (summary.arrivals[-1][1] if summary.arrivals else 0)))
                progress.update(summary.arrivals[-1][1], now)
                part_ids = batch.column(PART_COLUMN).to_numpy()
                for pid in np.unique(part_ids):
                    self._collect(by_index[int(pid)], batch.filter(pa.array(part_ids == pid)))
        except KeyboardInterrupt:
            print("[deployments.batch] interrupted; finished parts are kept, re-run to resume", file=sys.stderr)
            raise
        finally:
            summary.seconds = time.perf_counter() - start
            self.manifest.record_run(
                {
                    **self.cfg.model_dump(mode="json"),
                    "batch_size": options.batch_size,
                    "rows": summary.rows,
                    "error_rows": summary.error_rows,
                    "seconds": round(summary.seconds, 3),
                }
            )
        missing = sorted(set(by_index) - self._written)
        if missing:
            raise RuntimeError(f"parts {missing} did not get all their rows back")

    def _collect(self, part: Part, piece: pa.Table) -> None:
        """One batch's rows of `part`; the part is written once all its rows are back."""
        self._pending[part.index].append(piece)
        self._received[part.index] += piece.num_rows
        if self._received[part.index] > part.num_rows:
            raise RuntimeError(f"{part.name}: more rows came back than went in")
        if self._received[part.index] < part.num_rows:
            return
        table = write_part(self.manifest.out, part, self._pending.pop(part.index))
        self._written.add(part.index)
        if self._crash_after and len(self._written) >= self._crash_after:
            os._exit(75)
        errors = table.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
        n_err = int(errors.sum())
        if self.id_column:
            self.summary.error_ids.extend(table.column(self.id_column).filter(pa.array(errors)).to_pylist())
        self.manifest.record_part(part, self.files[part.file].path, n_err)
        self.summary.parts_done += 1
        self.summary.rows += part.num_rows
        self.summary.error_rows += n_err
