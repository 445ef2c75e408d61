"""A batch job's input files and parts: which files, which rows make part k, and reading them.

Parts are planned from the inputs alone: the input files in sorted order, each cut into row ranges of
`part_rows` rows; part k is always the same rows of the same file. A run reads only the rows of
unfinished parts: one read task per Parquet row group they touch (one per part for Arrow IPC), each
emitting its rows tagged with their part and row index.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from encoder.errors import InvalidArgumentError

PART_COLUMN = "_ve_part"  # internal: part index of a row
ROW_COLUMN = "_ve_row"  # internal: row index inside its input file
PARQUET_EXTENSIONS = (".parquet", ".pq")
IPC_EXTENSIONS = (".arrow", ".ipc", ".feather", ".arrows")


class JobError(InvalidArgumentError):
    """The job cannot start: bad input, or an output directory that belongs to a different job."""


@dataclass
class InputFile:
    path: str
    format: str  # "parquet" | "ipc-file" | "ipc-stream"
    num_rows: int
    bytes: int
    mtime_ns: int  # with the size, what tells a re-run that a file was rewritten (rsync's and make's test)
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


def _is_input(path: Path, root: Path) -> bool:
    """A data file under `root`, not hidden: no name on its way down starts with '.' or '_' (as pyarrow's
    datasets skip them: `.cache/`, Spark's in-progress `_temporary/`, `_SUCCESS`)."""
    hidden = any(name.startswith((".", "_")) for name in path.relative_to(root).parts)
    return not hidden and path.name.lower().endswith(PARQUET_EXTENSIONS + IPC_EXTENSIONS)


def discover(inputs: list[str]) -> list[Path]:
    """Input files: the given files, and under each directory every Parquet / Arrow file (sorted)."""
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser().resolve()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _is_input(p, path))
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


def open_ipc(path: Path) -> tuple[str, pa.Table]:
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
            stat = path.stat()
            info = InputFile(str(path), "parquet", meta.num_rows, stat.st_size, stat.st_mtime_ns, groups)
            return info, meta.schema.to_arrow_schema()
        kind, table = open_ipc(path)  # memory-mapped: zero-copy, only the metadata is read
        stat = path.stat()
        return InputFile(str(path), kind, table.num_rows, stat.st_size, stat.st_mtime_ns), table.schema
    except (OSError, pa.ArrowException) as exc:
        raise JobError(f"{path}: cannot read as Parquet or Arrow IPC: {exc}") from exc


def plan_parts(files: list[InputFile], part_rows: int) -> list[Part]:
    parts: list[Part] = []
    for f_index, info in enumerate(files):
        for start in range(0, info.num_rows, part_rows):
            parts.append(Part(len(parts), f_index, start, min(start + part_rows, info.num_rows)))
    return parts


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
        table = open_ipc(Path(unit["path"]))[1]
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


def head_values(info: InputFile, column: str, size: int = 32) -> tuple[list, pa.DataType]:
    """The first `size` values of a column of an input file (reads one batch), and the column's type."""
    if info.format == "parquet":
        pf = pq.ParquetFile(info.path)
        first = next(pf.iter_batches(batch_size=size, columns=[column]), None)
        return (first.column(0).to_pylist() if first is not None else []), pf.schema_arrow.field(column).type
    table = open_ipc(Path(info.path))[1]
    return table.column(column).slice(0, size).to_pylist(), table.schema.field(column).type
