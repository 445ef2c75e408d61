"""Writing the embeddings of a few named images to a file (`python -m encoder --output`).

Formats, chosen by the output's name:
  * `.npy`: the pooled vectors stacked, float32 [images, dim], rows in argument order; pooling
    "none" is refused (images have different token counts).
  * `.parquet`: one row per image, with the batch job's columns (`deployments.batch`): `image`
    (the path as given), `embedding` (`fixed_size_list<float32>[dim]`; pooling "none":
    `list<fixed_size_list<float32>[dim]>`, one vector per output token), and for "none"
    `num_tokens` (int32) and `grid_thw` (`fixed_size_list<int32>[3]`, the patch grid).
  * `-`: JSON Lines on stdout, one object per image: `image`, `grid_thw`, `shape`, `embedding`
    (nested lists of floats, every value).
Files are written to a temporary name beside the target and renamed, so a failure leaves no half file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from encoder.errors import InvalidArgumentError

STDOUT = "-"
FILE_SUFFIXES = (".npy", ".parquet")


@dataclass
class ImageEmbedding:
    """One image's result: its name, patch grid (t, h, w) and embedding ([dim] or [tokens, dim])."""

    image: str
    grid_thw: tuple[int, int, int]
    embedding: np.ndarray


def check_output(output: str, pooling: str | None = None) -> None:
    """Refuse an output that cannot be written before any work is done (the name, the format, the folder;
    with the pooling known, a format that cannot hold it)."""
    if output == STDOUT:
        return
    path = Path(output)
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise InvalidArgumentError(f"--output {output}: unknown format; use a .npy or .parquet file, or - for JSON")
    if path.suffix.lower() == ".npy" and pooling == "none":
        raise InvalidArgumentError(
            f"--output {output}: pooling 'none' gives each image its own number of tokens, which one .npy "
            "array cannot hold; write .parquet or - (JSON) instead"
        )
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"--output {output}: the folder {path.parent} does not exist")
    if path.is_dir():
        raise InvalidArgumentError(f"--output {output}: is a directory")


def write(results: Sequence[ImageEmbedding], output: str, stdout: BinaryIO) -> None:
    """Write `results` to `output` (a file name or `-` for `stdout`); raises OSError on write failure."""
    if output == STDOUT:
        write_json_lines(results, stdout)
        return
    path = Path(output)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if path.suffix.lower() == ".npy":
            with open(tmp, "wb") as f:
                np.save(f, np.stack([r.embedding for r in results]).astype(np.float32, copy=False))
        else:
            pq.write_table(embedding_table(results), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_lines(results: Sequence[ImageEmbedding], stdout: BinaryIO) -> None:
    for r in results:
        line = {"image": r.image, "grid_thw": list(r.grid_thw), "shape": list(r.embedding.shape),
                "embedding": np.ascontiguousarray(r.embedding, dtype=np.float32)}  # fmt: skip
        stdout.write(orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    stdout.flush()


def embedding_table(results: Sequence[ImageEmbedding]) -> pa.Table:
    """The Parquet rows: pooled vectors as `fixed_size_list`, per-token outputs as lists of them."""
    dim = int(results[0].embedding.shape[-1])
    values = pa.array(np.concatenate([r.embedding.reshape(-1) for r in results]).astype(np.float32, copy=False))
    vectors = pa.FixedSizeListArray.from_arrays(values, dim)
    columns = {"image": pa.array([r.image for r in results], pa.string())}
    if results[0].embedding.ndim == 1:
        columns["embedding"] = vectors
        return pa.table(columns)
    counts = np.array([r.embedding.shape[0] for r in results], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    columns["embedding"] = pa.ListArray.from_arrays(offsets, vectors)
    columns["num_tokens"] = pa.array(counts, pa.int32())
    grid = pa.array(np.array([r.grid_thw for r in results], dtype=np.int32).reshape(-1))
    columns["grid_thw"] = pa.FixedSizeListArray.from_arrays(grid, 3)
    return pa.table(columns)
