"""The decode stage of a batch job (Ray tasks, CPU): each row's image to uint8 pixels at the model's size.

A row's image (encoded bytes, a local file path, or a Hugging Face `datasets` image struct) is decoded,
checked and resized with `encoder.preprocessing` (`load_image`, then the model's resize, `pp.resize`: Qwen's smart
resize, or the CLIP / SigLIP resize and crop). The stage ships compact uint8
pixels (a quarter of the bytes of float32 patches) plus the patch count; a bad image becomes an `error`
string on its row, never an exception.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

import pyarrow as pa
from PIL import Image

import encoder
from deployments.batch.columns import (
    ERROR,
    FRAMES,
    HEIGHT,
    INTERNAL,
    OUTPUT_COLUMNS,
    PATCHES,
    PER_GRID,
    PIXELS,
    STAMPS,
    STAMPS_TYPE,
    VIDEO_COLUMNS,
    WIDTH,
)
from deployments.batch.image_files import DEFAULT_MAX_IMAGE_BYTES, read_image_file, resolve
from encoder.errors import InvalidArgumentError
from encoder.preprocessing.config import ProcessorConfig
from encoder.preprocessing.images import harden_pillow, load_image


def image_column_kind(typ: pa.DataType) -> str:
    """'bytes', 'path' or 'struct' (Hugging Face `datasets` Image: struct<bytes, path>) for a column type."""
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_fixed_size_binary(typ):
        return "bytes"
    if getattr(pa.types, "is_binary_view", lambda _t: False)(typ):
        return "bytes"
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "path"
    if getattr(pa.types, "is_string_view", lambda _t: False)(typ):
        return "path"
    if pa.types.is_struct(typ) and {typ.field(i).name for i in range(typ.num_fields)} >= {"bytes", "path"}:
        return "struct"
    raise InvalidArgumentError(
        f"image column has type {typ}; expected binary (encoded image bytes), string (local file paths) "
        "or struct<bytes, path>"
    )


def check_input_schema(schema: pa.Schema, image_column: str, video: bool = False) -> None:
    """Fail early (before any work) on a missing image column or a clash with output column names (`video`, a
    `video_column` job: its video columns too, `timestamps` and `second_per_grid_ts`)."""
    if image_column not in schema.names:
        raise InvalidArgumentError(f"no column {image_column!r} in the input; columns: {', '.join(schema.names)}")
    image_column_kind(schema.field(image_column).type)
    taken = set(OUTPUT_COLUMNS) | set(INTERNAL) | (set(VIDEO_COLUMNS) if video else set())
    clash = sorted(set(schema.names) & taken)
    if clash:
        raise InvalidArgumentError(
            f"input column(s) {', '.join(clash)} would be overwritten by the output; rename them first"
        )


def _image_bytes(value: Any, kind: str, root: str | None, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    if kind == "struct":
        if value is None:
            value = {}
        if value.get("bytes") is not None:
            data = value["bytes"]
        elif value.get("path") is not None:
            return read_image_file(resolve(value["path"], root), max_bytes)
        else:
            raise encoder.ImageDecodeError("image is null")
    elif value is None:
        raise encoder.ImageDecodeError("image is null")
    elif kind == "path":
        return read_image_file(resolve(value, root), max_bytes)
    else:
        data = bytes(value)
    if len(data) > max_bytes:
        raise encoder.ImageTooLargeError(f"image is {len(data)} bytes, over the limit of {max_bytes} (max_image_bytes)")
    return data


def _named_path(value: Any, kind: str) -> str | None:
    """The file a row's image comes from, if it comes from a file (error rows name it)."""
    if kind == "path" and isinstance(value, str):
        return value
    if kind == "struct" and isinstance(value, dict) and value.get("bytes") is None:
        return value.get("path")
    return None


def describe_error(exc: BaseException, path: str | None = None) -> str:
    text = str(exc) or repr(exc)
    if path is not None and path not in text:
        text = f"{path}: {text}"
    return f"{type(exc).__name__}: {text}"


def decode_batch(
    table: pa.Table,
    *,
    image_column: str,
    pp: ProcessorConfig,
    path_root: str | None,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    video_cfg=None,
) -> pa.Table:
    """Decode + resize one batch; returns the non-image columns plus pixels, sizes, patches and `error`.

    Never raises for a bad image: its row gets pixels = null, patches = 0 and the reason in `error`. With
    `video_cfg` (a `VideoPreprocessConfig`: a `--video-column` job) the column holds videos, decoded with PyAV
    within its limits and sampled and resized as the video processor (`decode_video_batch`).
    """
    if video_cfg is not None:
        return decode_video_batch(table, video_column=image_column, vcfg=video_cfg, path_root=path_root)
    # A Ray worker of ours: the same Pillow hardening as the ingress (a refused bomb is its row's `error`, not a
    # warning too; PNG text chunks capped at 8 MiB). Idempotent, so once per batch is once per process in effect.
    harden_pillow(pp.max_image_pixels)
    check_input_schema(table.schema, image_column)
    kind = image_column_kind(table.schema.field(image_column).type)
    values = table.column(image_column).to_pylist()
    pixels: list[bytes | None] = []
    heights, widths, patches, errors = [], [], [], []
    for value in values:
        try:
            array = pp.resize(load_image(_image_bytes(value, kind, path_root, max_image_bytes), pp))
        except Exception as exc:  # a bad row must never fail the job (Pillow raises many types)
            pixels.append(None)
            heights.append(0)
            widths.append(0)
            patches.append(0)
            errors.append(describe_error(exc, _named_path(value, kind)))
            continue
        h, w, _ = array.shape
        pixels.append(array.tobytes())
        heights.append(h)
        widths.append(w)
        patches.append((h // pp.patch_size) * (w // pp.patch_size))
        errors.append(None)
    return decoded_table(table, image_column, pixels, heights, widths, patches, errors)


def decoded_table(table: pa.Table, column: str, pixels, heights, widths, patches, errors, extra=()) -> pa.Table:
    """`table` with its input `column` replaced by the decoded columns (PIXELS, HEIGHT, WIDTH, PATCHES, then each
    `extra` (name, arrow array), ERROR last): the decode tasks' output for the encoder actors."""
    out = table.drop_columns([column])
    out = out.append_column(PIXELS, pa.array(pixels, type=pa.large_binary()))
    out = out.append_column(HEIGHT, pa.array(heights, type=pa.int32()))
    out = out.append_column(WIDTH, pa.array(widths, type=pa.int32()))
    out = out.append_column(PATCHES, pa.array(patches, type=pa.int32()))
    for name, array in extra:
        out = out.append_column(name, array)
    return out.append_column(ERROR, pa.array(errors, type=pa.string()))


def decode_video_batch(table: pa.Table, *, video_column: str, vcfg, path_root: str | None) -> pa.Table:
    """`decode_batch` of a video column: per row its sampled, resized frames (uint8 n*H*W*3 in PIXELS, n in
    FRAMES), their patches (`cfg.grid`: ceil(n / T) x H/P x W/P) and the video's facts from its preprocessing
    (Qwen3-VL's timestamps in STAMPS, Qwen2/2.5-VL's second_per_grid_ts in PER_GRID; null where the tower has
    none); a bad video (unreadable, truncated, no frames, over a limit) is an error row."""
    from deployments.wire import patch_count
    from encoder.preprocessing.video_decode import load_video  # PyAV: only in video jobs' decode tasks

    check_input_schema(table.schema, video_column, video=True)
    kind = image_column_kind(table.schema.field(video_column).type)
    pixels: list[bytes | None] = []
    frames, heights, widths, patches, errors = [], [], [], [], []
    stamps: list[list[float] | None] = []
    per_grid: list[float | None] = []
    for value in table.column(video_column).to_pylist():
        try:
            prepared = load_video(_image_bytes(value, kind, path_root, vcfg.limits.max_bytes), vcfg)
        except Exception as exc:  # a bad row must never fail the job (PyAV raises many types)
            pixels.append(None)
            frames.append(0)
            heights.append(0)
            widths.append(0)
            patches.append(0)
            stamps.append(None)
            per_grid.append(None)
            errors.append(describe_error(exc, _named_path(value, kind)))
            continue
        array = prepared.frames
        pixels.append(array.tobytes())
        frames.append(array.shape[0])
        heights.append(array.shape[1])
        widths.append(array.shape[2])
        patches.append(patch_count(array, vcfg.patch_size, vcfg.temporal_patch_size))
        stamps.append(prepared.timestamps)
        per_grid.append(prepared.second_per_grid_ts)
        errors.append(None)
    extra = [(FRAMES, pa.array(frames, type=pa.int32())), (STAMPS, pa.array(stamps, type=STAMPS_TYPE)),
             (PER_GRID, pa.array(per_grid, type=pa.float32()))]  # fmt: skip
    return decoded_table(table, video_column, pixels, heights, widths, patches, errors, extra)


def header_patches(value: Any, kind: str, pp: ProcessorConfig, path_root: str | None) -> int | None:
    """Patch count from the image header only (no pixel decode); None when unreadable."""

    try:
        with Image.open(io.BytesIO(_image_bytes(value, kind, path_root))) as img:
            width, height = img.size
        return pp.num_patches(height, width)
    except Exception:
        return None


def typical_patches_of(values: list, kind: str, pp: ProcessorConfig, path_root: str | None, default=256) -> int:
    """Median patch count of a sample of image-column values (header reads only)."""
    counts = [c for c in (header_patches(v, kind, pp, path_root) for v in values) if c]
    return int(statistics.median(counts)) if counts else default
