"""A batch job's output directory: its manifest (what resuming trusts), its lock and its part files.

Layout of the output directory:

    DIR/part-000000.parquet ... one file per part, written to a temporary name, then renamed
    DIR/_manifest.json          the job's parameters and the finished parts (rewritten atomically)
    DIR/.lock                   held (flock) while a run is going; a second run on DIR is refused

A part is recorded in the manifest only after its file was renamed into place, so after a crash a part
written but not recorded is simply recomputed and renamed over (no duplicates, no gaps), and half-written
temporaries are removed when the next run opens the directory. A run with parameters other than the
manifest's (inputs, model, pooling, columns, part size) is refused rather than mixing results.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deployments.batch.files import PART_COLUMN, ROW_COLUMN, JobError, Part

MANIFEST = "_manifest.json"
MANIFEST_FORMAT = "vision-encoding-service/batch-manifest/1"


class OutputWriteError(Exception):
    """A file of the output directory could not be written (disk full, over quota, read-only, no permission):
    the job ends with one line naming the file and the cause (exit 3); finished parts are kept."""

    def __init__(self, path: Path, exc: OSError):
        cause = exc.strerror or str(exc) or type(exc).__name__
        super().__init__(f"cannot write {path}: {cause}; finished parts are kept, re-run to resume once it can be")
        self.path, self.errno = path, exc.errno


@contextlib.contextmanager
def writing(path: Path, tmp: Path) -> Iterator[None]:
    """Write `path` through `tmp`: an OSError becomes OutputWriteError naming `path`, and `tmp` is removed."""
    try:
        yield
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OutputWriteError(path, exc) from exc


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path, tmp):
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def _changed_input(old: list[dict], new: list[dict]) -> str:
    """': <the first input file that differs, and how>', or '' when the inputs are the same."""
    before, now = {f.get("path"): f for f in old}, {f.get("path"): f for f in new}
    for path in sorted(set(before) | set(now), key=str):
        if path not in now:
            return f": {path} is no longer an input"
        if path not in before:
            return f": {path} is a new input"
        if before[path] != now[path]:
            return f": {path} was rewritten since the job started"
    return ""


class Manifest:
    """The manifest of one output directory: `Manifest.open(out, params)` reads it (or starts a new one) and
    refuses one whose parameters differ; `record_part` / `record_run` / `finish` rewrite it atomically."""

    def __init__(self, out: Path, data: dict[str, Any]):
        self.out, self.data = out, data

    @classmethod
    def open(cls, out: Path, params: dict) -> Manifest:
        path = out / MANIFEST
        if not path.exists():
            return cls(out, {"format": MANIFEST_FORMAT, "params": params, "parts": {}, "runs": []})
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise JobError(f"{path}: unreadable manifest ({exc}); remove it to start over") from exc
        if data.get("format") != MANIFEST_FORMAT:
            raise JobError(f"{path}: not a manifest of this tool")
        old = data.get("params", {})
        diffs = [k for k in sorted(set(old) | set(params)) if old.get(k) != params.get(k)]
        if diffs:
            changed = _changed_input(old.get("inputs") or [], params.get("inputs") or [])
            named = "; ".join(k + changed if k == "inputs" else k for k in diffs)
            raise JobError(
                f"{out} holds a job with different parameters ({named}); use a new --output directory or delete "
                "this one"
            )
        return cls(out, data)

    def path_root(self, default: str) -> str:
        """Where the job's relative image paths resolve: the directory the job started with (`default` for a new
        job, or a manifest written before this was recorded). A resume from another working directory still reads
        the images the first run read, so its parts match the ones already written."""
        return self.data.setdefault("path_root", default)

    def done(self) -> set[str]:
        """Names of the recorded parts whose files exist."""
        return {name for name in self.data["parts"] if (self.out / name).exists()}

    def record_part(self, part: Part, file: str, error_rows: int) -> None:
        self.data["parts"][part.name] = {
            "file": file,
            "rows": [part.start, part.stop],
            "num_rows": part.num_rows,
            "error_rows": error_rows,
        }
        self.write()

    def record_run(self, run: dict) -> None:
        self.data["runs"].append(run)
        self.write()

    def finish(self, complete: bool) -> None:
        self.data["complete"] = complete
        self.write()

    def write(self) -> None:
        write_json_atomic(self.out / MANIFEST, self.data)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold the directory's lock (a second run on it gets JobError); half-written temporaries are removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no protection against concurrent runs
        _remove_temporaries(out)
        yield
        return
    with open(out / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(f"{out}: another run is writing this output directory") from None
        try:
            _remove_temporaries(out)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_temporaries(out: Path) -> None:
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
    with writing(out / part.name, tmp):
        pq.write_table(table, tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out / part.name)
    return table
