"""`embed_dataset`: images in an Arrow column -> embeddings, with Ray Data.

The pipeline has two stages:

1. **decode** (Ray tasks, CPU): each row's image (encoded bytes, or a local file path) is decoded,
   checked and resized to the model's size with `encoder.preprocess` (`load_image`, then
   `resize_image`, or the CLIP / SigLIP resize and crop through `encoder.preprocess_vit`).
   The stage ships compact uint8 pixels (a quarter of the bytes of float32 patches) plus the
   patch count; a bad image becomes an `error` string on its row, never an exception.
2. **encode** (`EncoderActor`, an actor pool; one GPU per actor where GPUs exist): the actor builds
   a `workspace.GraphEncoder` in its constructor (CUDA graphs captured there), normalises and
   patchifies on its device, orders each batch so the runner's packs fill the largest bucket
   (first-fit decreasing), runs it and adds the `embedding` column (with `pooling="none"`, the
   LLM-ready outputs of `GraphEncoder.encode_llm`: tokens, patch grid and DeepStack features).

Output columns with `pooling="none"` (one row per image; every column null or 0 on error rows):
  * `embedding`: `list<fixed_size_list<float32>[out_dim]>`, the merger's tokens in order (row-major over
    the (grid_h / m) x (grid_w / m) token grid, m = `spatial_merge_size`), what replaces the image's
    placeholder tokens in the LLM.
  * `num_tokens`, `grid_t`, `grid_h`, `grid_w`: `int32`, the tokens and the patch grid = the Hugging Face
    processor's `image_grid_thw` row, which the LLM's M-RoPE positions are computed from
    (`num_tokens = grid_t * grid_h * grid_w / m**2`; `grid_t` is 1 for images).
  * `grid_thw`: `fixed_size_list<int32>[3]`, the same patch grid as one value `[grid_t, grid_h, grid_w]`.
  * `deepstack` (DeepStack models only, e.g. Qwen3-VL): `list<list<fixed_size_list<float32>[out_dim]>>`,
    `deepstack[k][t]` = DeepStack layer k's feature of token t, layers in the model's order
    (`deepstack_visual_indexes`); the LLM adds layer k's features at the image positions after decoder
    layer k.

Ray Data batches by rows, so rows per encoder batch are chosen from the typical patch count
(about two of the actor's batches of patches: `rows_per_batch`); inside a batch the actor re-orders images by the
bucket table. Rows out = rows in, in any order; every non-image column is passed through.
"""

from __future__ import annotations

import io
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

import encoder
from encoder.api import POOLINGS, select_backend, vector_pooling
from encoder.api import preprocess_config_for as model_preprocess_config
from encoder.checkpoint import load_config
from encoder.config import VisionConfig
from encoder.errors import InvalidArgumentError
from encoder.patch_batch import PatchBatch
from encoder.preprocess import PreprocessConfig, load_image, patchify
from encoder.preprocess_vit import num_patches_for, resize_image_for
from encoder.presets import preset
from workspace.buckets import BucketKey, BucketTable
from workspace.graph_encoder import GraphEncoder
from workspace.tables import BucketPlan, process_plan, shape_of_config, shape_of_encoder

# Internal columns between the stages; never in the output.
PIXELS = "_ve_pixels"  # large_binary: uint8 H*W*3, row-major RGB, at the model's size
HEIGHT = "_ve_height"  # int32: resized height (multiple of patch_size * merge_size)
WIDTH = "_ve_width"  # int32
PATCHES = "_ve_patches"  # int32: patches (grid t*h*w) of the resized image; 0 for error rows
INTERNAL = (PIXELS, HEIGHT, WIDTH, PATCHES)

# Output columns.
EMBEDDING = "embedding"
ERROR = "error"
NUM_TOKENS = "num_tokens"
GRID_T = "grid_t"
GRID_H = "grid_h"
GRID_W = "grid_w"
GRID_THW = "grid_thw"
DEEPSTACK = "deepstack"
OUTPUT_COLUMNS = (EMBEDDING, ERROR, NUM_TOKENS, GRID_T, GRID_H, GRID_W, GRID_THW, DEEPSTACK)


# ------------------------------------------------------------------------------------- configuration


def config_for(model: str) -> VisionConfig:
    """The tower config of a preset name or checkpoint directory (no weights read)."""
    path = Path(model)
    return load_config(path) if path.is_dir() else preset(model)


def preprocess_config_for(model: str) -> PreprocessConfig:
    """The preprocessing `encoder.load(model)` uses, without building the model (cheap, driver side).

    A `VitPreprocessConfig` for CLIP / SigLIP models (same attributes where the pipeline reads them)."""
    path = Path(model)
    return model_preprocess_config(config_for(model), path if path.is_dir() else None)


def deepstack_layers(config: VisionConfig) -> int:
    """DeepStack layers of a tower (0 for towers without: Qwen2/2.5-VL, Qwen3.5, CLIP, SigLIP)."""
    return len(getattr(config, "deepstack_visual_indexes", None) or ())


def resolve_pooling(pooling: str | None, model: str) -> str:
    """`pooling`, checked; None: the model's default embedding ("model" for CLIP / SigLIP, else "mean")."""
    config = config_for(model)
    if pooling is None:
        return vector_pooling(config)
    if pooling not in POOLINGS:
        raise InvalidArgumentError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}")
    return encoder.api.resolve_pooling(pooling, config)


def actor_device(gpus: int) -> str:
    """The device the encoder actors run on: one GPU each when the job has GPUs."""
    return "cuda" if gpus > 0 else "cpu"


def _graph_cap(model: str, device: str, dtype: str | None, attention: str | None) -> int | None:
    return select_backend(config_for(model), device, dtype, attention).max_graph_tokens


def actor_graph_cap(model: str, device: str, dtype: str | None = None, attention: str | None = None) -> int | None:
    """`max_graph_tokens` of the attention backend the encoder actors will load. Which backends are usable
    depends on the machine, so a driver that cannot see CUDA asks a GPU worker once."""
    if device == "cuda" and not torch.cuda.is_available():
        import ray

        return ray.get(ray.remote(num_gpus=1)(_graph_cap).remote(model, device, dtype, attention))
    return _graph_cap(model, device, dtype, attention)


def actor_plan(model: str, device: str, buckets: Any = None, max_graph_tokens: int | None = None) -> BucketPlan:
    """The bucket table (and batch limits) of an encoder actor on `device`, from the model's config alone:
    the same `workspace.tables.process_plan` the actor itself calls."""
    return process_plan(
        shape_of_config(config_for(model), preprocess_config_for(model)), device, buckets,
        max_graph_tokens=max_graph_tokens,
    )  # fmt: skip


def rows_per_batch(plan: BucketPlan, typical_patches: int, fill: int = 2) -> int:
    """Rows per encoder batch so a batch holds about `fill` batches' worth of patches of the actor's limits."""
    rows = round(fill * plan.max_batch_patches / max(1, typical_patches))
    return int(min(max(rows, 1), fill * plan.max_batch_images))


def gpus_in_cluster() -> int:
    import ray

    if not ray.is_initialized():
        ray.init()
    return int(ray.cluster_resources().get("GPU", 0))


# ------------------------------------------------------------------------------------- decode stage


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


def check_input_schema(schema: pa.Schema, image_column: str) -> None:
    """Fail early (before any work) on a missing image column or a clash with output column names."""
    if image_column not in schema.names:
        raise InvalidArgumentError(f"no column {image_column!r} in the input; columns: {', '.join(schema.names)}")
    image_column_kind(schema.field(image_column).type)
    clash = sorted(set(schema.names) & (set(OUTPUT_COLUMNS) | set(INTERNAL)))
    if clash:
        raise InvalidArgumentError(
            f"input column(s) {', '.join(clash)} would be overwritten by the output; rename them first"
        )


def _read_path(value: str, root: str | None) -> bytes:
    if value.startswith("file://"):
        value = value[len("file://") :]
    path = Path(value)
    if not path.is_absolute() and root is not None:
        path = Path(root) / path
    return path.read_bytes()


def _image_bytes(value: Any, kind: str, root: str | None) -> bytes:
    if kind == "struct":
        if value is None:
            value = {}
        if value.get("bytes") is not None:
            return value["bytes"]
        if value.get("path") is not None:
            return _read_path(value["path"], root)
        raise encoder.ImageDecodeError("image is null")
    if value is None:
        raise encoder.ImageDecodeError("image is null")
    return _read_path(value, root) if kind == "path" else bytes(value)


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def decode_batch(table: pa.Table, *, image_column: str, pp: PreprocessConfig, path_root: str | None) -> pa.Table:
    """Decode + resize one batch; returns the non-image columns plus pixels, sizes, patches and `error`.

    Never raises for a bad image: its row gets pixels = null, patches = 0 and the reason in `error`.
    """
    check_input_schema(table.schema, image_column)
    kind = image_column_kind(table.schema.field(image_column).type)
    values = table.column(image_column).to_pylist()
    pixels: list[bytes | None] = []
    heights, widths, patches, errors = [], [], [], []
    for value in values:
        try:
            array = resize_image_for(load_image(_image_bytes(value, kind, path_root), pp), pp)
        except Exception as exc:  # a bad row must never fail the job (Pillow raises many types)
            pixels.append(None)
            heights.append(0)
            widths.append(0)
            patches.append(0)
            errors.append(_describe(exc))
            continue
        h, w, _ = array.shape
        pixels.append(array.tobytes())
        heights.append(h)
        widths.append(w)
        patches.append((h // pp.patch_size) * (w // pp.patch_size))
        errors.append(None)
    out = table.drop_columns([image_column])
    out = out.append_column(PIXELS, pa.array(pixels, type=pa.large_binary()))
    out = out.append_column(HEIGHT, pa.array(heights, type=pa.int32()))
    out = out.append_column(WIDTH, pa.array(widths, type=pa.int32()))
    out = out.append_column(PATCHES, pa.array(patches, type=pa.int32()))
    return out.append_column(ERROR, pa.array(errors, type=pa.string()))


def header_patches(value: Any, kind: str, pp: PreprocessConfig, path_root: str | None) -> int | None:
    """Patch count from the image header only (no pixel decode); None when unreadable."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(_image_bytes(value, kind, path_root))) as img:
            width, height = img.size
        return num_patches_for(height, width, pp)
    except Exception:
        return None


def typical_patches_of(values: list, kind: str, pp: PreprocessConfig, path_root: str | None, default=256) -> int:
    """Median patch count of a sample of image-column values (header reads only)."""
    counts = [c for c in (header_patches(v, kind, pp, path_root) for v in values) if c]
    return int(statistics.median(counts)) if counts else default


# ------------------------------------------------------------------------------------- encode stage


def fill_order(counts: list[int], sizes: list[tuple[int, int]], largest: BucketKey) -> list[int]:
    """Order images so the runner's greedy in-order packing fills buckets (first-fit decreasing).

    Images go, largest first, into the first bin (capacity: the largest bucket's budget and image
    count) with room; bins are emitted in creation order. Every image of a later bin did not fit any
    earlier bin when it was placed, and bins only grow, so `BucketTable.pack` over this order cuts
    exactly at the bin boundaries. Inside a bin, images of one size are adjacent (one patchify call
    per run of equal sizes). Images above the largest budget get a bin of their own (run eagerly).
    """
    bins: list[list[int]] = []
    totals: list[float] = []
    for i in sorted(range(len(counts)), key=lambda j: (-counts[j], j)):
        c = counts[i]
        for b, members in enumerate(bins):
            if totals[b] + c <= largest.budget and len(members) < largest.max_images:
                members.append(i)
                totals[b] += c
                break
        else:
            bins.append([i])
            totals.append(c if c <= largest.budget else math.inf)
    return [i for members in bins for i in sorted(members, key=lambda j: (sizes[j], j))]


def _fixed_size_list(values: np.ndarray, dim: int, null_mask: np.ndarray | None) -> pa.Array:
    flat = pa.array(values.reshape(-1), type=pa.float32())
    mask = pa.array(null_mask) if null_mask is not None and null_mask.any() else None
    return pa.FixedSizeListArray.from_arrays(flat, dim, mask=mask)


def _vectors(arrays: list[np.ndarray], dim: int) -> pa.Array:
    """`fixed_size_list<float32>[dim]` of the rows of [n_i, dim] arrays, in order (one concatenation)."""
    values = np.concatenate(arrays) if arrays else np.zeros((0, dim), dtype=np.float32)
    return _fixed_size_list(values, dim, None)


def _lists(sizes: list[int], inner: pa.Array, valid: np.ndarray | None = None) -> pa.Array:
    """A list array over `inner`, `sizes[i]` items in list i; null where not `valid`."""
    offsets = np.zeros(len(sizes) + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    mask = pa.array(~valid) if valid is not None and not valid.all() else None
    return pa.ListArray.from_arrays(pa.array(offsets), inner, mask=mask)


def _pixel_rows(column: pa.ChunkedArray | pa.Array, device: torch.device) -> list[torch.Tensor | None]:
    """Each row's pixel bytes as a flat uint8 tensor on `device` (None for null rows).

    One host-to-device copy per Arrow chunk, no host-side concatenation: rows are views into it.
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    rows: list[torch.Tensor | None] = []
    for arr in chunks:
        n = len(arr)
        if n == 0:
            continue
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + n + 1]
        data = arr.buffers()[2]
        if data is None or offsets[-1] == offsets[0]:
            rows.extend([None] * n)
            continue
        with warnings.catch_warnings():  # Ray hands read-only, zero-copy buffers; we only read them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(np.frombuffer(data, dtype=np.uint8)[int(offsets[0]) : int(offsets[-1])])
        if device.type != "cpu":
            flat = flat.to(device)
        base = int(offsets[0])
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        for i in range(n):
            lo, hi = int(offsets[i]) - base, int(offsets[i + 1]) - base
            rows.append(flat[lo:hi] if valid[i] else None)
    return rows


class EncoderActor:
    """Ray Data callable class: uint8 pixels -> `embedding` column. One per GPU (or CPU worker).

    The `GraphEncoder` is built (and, on CUDA, every bucket graph captured) in the constructor, so
    graph capture happens once per actor, before its first batch.
    """

    def __init__(
        self,
        model: str = "tiny",
        pooling: str | None = "mean",
        buckets: Any = None,
        dtype: str | None = None,
        attention: str | None = None,
        preprocess_config: PreprocessConfig | None = None,
        expected_table: BucketTable | None = None,
    ):
        start = time.perf_counter()
        self.pooling = resolve_pooling(pooling, model)
        self.vision = encoder.load(model, dtype=dtype, attention=attention)
        if preprocess_config is not None and preprocess_config != self.vision.preprocess_config:
            raise InvalidArgumentError("the decode stage's preprocessing differs from the model's (driver/actor drift)")
        self.pp = self.vision.preprocess_config
        self.plan = process_plan(
            shape_of_encoder(self.vision), self.vision.device.type, buckets,
            max_graph_tokens=self.vision.model.backend.max_graph_tokens,
        )  # fmt: skip
        if expected_table is not None and self.plan.table != expected_table:
            raise InvalidArgumentError(
                f"the driver sized batches for the bucket table {expected_table}, but this actor has "
                f"{self.plan.table} (driver/actor drift: another attention backend or device here?)"
            )
        self.engine = GraphEncoder(self.vision, self.plan.table)
        self.device = self.vision.device
        self.dim = self.vision.output_dim(self.pooling)
        self.deepstack_layers = deepstack_layers(self.vision.config) if self.pooling == "none" else 0
        stats = self.engine.stats()
        print(
            f"[deployments.batch] encoder {self.vision.name} on {self.device} ({self.vision.dtype}): "
            f"{len(self.engine.table)} buckets up to {self.engine.table.largest.budget} patches, "
            f"{stats['captures']} graphs captured in {stats['capture_seconds']:.1f} s, "
            f"ready in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    # -- one Ray Data batch -------------------------------------------------------------------------
    def __call__(self, table: pa.Table) -> pa.Table:
        n = table.num_rows
        errors = table.column(ERROR).to_pylist()
        ok = [i for i in range(n) if errors[i] is None]
        counts = table.column(PATCHES).to_numpy(zero_copy_only=False)
        heights = table.column(HEIGHT).to_numpy(zero_copy_only=False)
        widths = table.column(WIDTH).to_numpy(zero_copy_only=False)
        results: dict[int, torch.Tensor] = {}
        if ok:
            rows = _pixel_rows(table.column(PIXELS), self.device)

            def image(i: int) -> torch.Tensor:
                return rows[i].view(int(heights[i]), int(widths[i]), 3)

            order = [
                ok[j]
                for j in fill_order(
                    [int(counts[i]) for i in ok],
                    [(int(heights[i]), int(widths[i])) for i in ok],
                    self.engine.table.largest,
                )
            ]
            results = self._encode(order, image, heights, widths, errors)
        return self._output(table, results, errors)

    def _patch_batch(self, order: list[int], image, heights, widths) -> PatchBatch:
        p = self.pp.patch_size
        parts, grid = [], []
        start = 0
        while start < len(order):  # one patchify per run of equal sizes: a vertical stack of images
            end = start + 1
            size = (heights[order[start]], widths[order[start]])
            while end < len(order) and (heights[order[end]], widths[order[end]]) == size:
                end += 1
            run = [image(i) for i in order[start:end]]
            parts.append(patchify(run[0] if len(run) == 1 else torch.cat(run), self.pp))
            grid.extend([(1, int(size[0]) // p, int(size[1]) // p)] * (end - start))
            start = end
        return PatchBatch(torch.cat(parts), torch.tensor(grid, dtype=torch.int64).reshape(-1, 3))

    def _run(self, batch: PatchBatch) -> list:
        """Per image a pooled vector, or with pooling="none" an `encoder.outputs.LLMOutput` (tokens, DeepStack
        features, patch grid)."""
        if self.pooling == "none":
            return self.engine.encode_llm(batch)
        return self.engine.encode(batch, pooling=self.pooling)

    def _encode(self, order, image, heights, widths, errors) -> dict[int, Any]:
        try:
            outs = self._run(self._patch_batch(order, image, heights, widths))
            return dict(zip(order, outs, strict=True))
        except Exception as batch_exc:
            if len(order) == 1:
                raise
            # Isolate the culprit: images that fail alone become error rows; if every image fails
            # alone, the problem is not the data (device, model): fail the job.
            results = {}
            for i in order:
                try:
                    (out,) = self._run(self._patch_batch([i], image, heights, widths))
                    results[i] = out
                except Exception as exc:
                    errors[i] = f"encode failed: {_describe(exc)}"
            if not results:
                raise batch_exc
            return results

    def _output(self, table: pa.Table, results: dict[int, Any], errors: list) -> pa.Table:
        n = table.num_rows
        valid = np.array([i in results for i in range(n)], dtype=bool)
        out = table.drop_columns([c for c in (*INTERNAL, ERROR) if c in table.column_names])
        if self.pooling != "none":
            values = np.zeros((n, self.dim), dtype=np.float32)
            for i, vec in results.items():
                values[i] = vec.numpy()
            out = out.append_column(EMBEDDING, _fixed_size_list(values, self.dim, ~valid))
        else:  # LLM-ready outputs (layout: the module docstring)
            rows = [i for i in range(n) if i in results]
            grid = np.zeros((n, 3), dtype=np.int32)
            for i in rows:
                grid[i] = results[i].grid_thw
            tokens = np.zeros(n, dtype=np.int64)
            tokens[rows] = [len(results[i].tokens) for i in rows]
            vectors = _vectors([results[i].tokens.numpy() for i in rows], self.dim)
            out = out.append_column(EMBEDDING, _lists(tokens.tolist(), vectors, valid))
            out = out.append_column(NUM_TOKENS, pa.array(tokens, type=pa.int32()))
            out = out.append_column(GRID_T, pa.array(grid[:, 0], type=pa.int32()))
            out = out.append_column(GRID_H, pa.array(grid[:, 1], type=pa.int32()))
            out = out.append_column(GRID_W, pa.array(grid[:, 2], type=pa.int32()))
            mask = pa.array(~valid) if not valid.all() else None
            out = out.append_column(
                GRID_THW, pa.FixedSizeListArray.from_arrays(pa.array(grid.reshape(-1)), 3, mask=mask)
            )
            if self.deepstack_layers:
                k = self.deepstack_layers
                if any(len(results[i].deepstack) != k for i in rows):
                    raise RuntimeError(f"the engine returned DeepStack layers other than the config's {k}")
                layers = _vectors([d.numpy() for i in rows for d in results[i].deepstack], self.dim)
                per_layer = _lists([int(tokens[i]) for i in rows for _ in range(k)], layers)  # a list per (row, layer)
                out = out.append_column(DEEPSTACK, _lists([k if valid[i] else 0 for i in range(n)], per_layer, valid))
        return out.append_column(ERROR, pa.array(errors, type=pa.string()))


def output_schema(
    input_schema: pa.Schema, image_column: str, pooling: str, dim: int, deepstack_layers: int = 0
) -> pa.Schema:
    """The schema `embed_dataset` produces for an input schema (documented layout in the module docstring);
    `deepstack_layers` (pooling="none"): the model's DeepStack layers (`deepstack_layers(config)`)."""
    fields = [f for f in input_schema if f.name != image_column]
    vector = pa.list_(pa.float32(), dim)
    if pooling != "none":
        fields.append(pa.field(EMBEDDING, vector))
    else:
        fields += [
            pa.field(EMBEDDING, pa.list_(vector)),
            pa.field(NUM_TOKENS, pa.int32()),
            pa.field(GRID_T, pa.int32()),
            pa.field(GRID_H, pa.int32()),
            pa.field(GRID_W, pa.int32()),
            pa.field(GRID_THW, pa.list_(pa.int32(), 3)),
        ]
        if deepstack_layers:
            fields.append(pa.field(DEEPSTACK, pa.list_(pa.list_(vector))))
    return pa.schema([*fields, pa.field(ERROR, pa.string())])


# ------------------------------------------------------------------------------------- the pipeline


def embed_dataset(
    ds,
    *,
    model: str = "tiny",
    image_column: str = "image",
    pooling: str | None = "mean",
    batch_size: int | None = None,
    typical_patches: int | None = None,
    num_gpus: int | None = None,
    num_actors: int | None = None,
    actor_cpus: float = 1.0,
    buckets: Any = None,
    dtype: str | None = None,
    attention: str | None = None,
    decode_batch_size: int = 32,
    decode_concurrency: int | None = None,
    decode_cpus: float = 1.0,
    path_root: str | None = None,
):
    """Embed the images of `ds[image_column]`; returns a lazy `ray.data.Dataset`.

    Output rows: every input column except the image column, then `embedding` and `error`:
      * pooling="mean" (or "model", "mean-l2", "model-l2"; None = the model's default: "model" for
        CLIP / SigLIP, "mean" otherwise; see `encoder.api`): `embedding` is
        `fixed_size_list<float32>[dim]` (null for error rows);
      * pooling="none": `embedding` is `list<fixed_size_list<float32>[out_dim]>`, one vector per
        output token in the merger's order (row-major over the merged `grid_h` x `grid_w` grid), plus
        `num_tokens` and the patch grid `grid_t`, `grid_h`, `grid_w` = HF's `image_grid_thw` (int32, 0 for
        error rows), the same grid as one `grid_thw` value and, for DeepStack models, `deepstack` (see
        the module docstring);
      * `error`: null, or why the row's image could not be embedded (`ImageDecodeError: ...`).
    Rows out = rows in; row order is not kept (carry an id column).

    The image column holds encoded bytes (binary), local file paths (string; relative ones are
    resolved against `path_root`, default the caller's working directory) or Hugging Face
    `datasets` image structs (`struct<bytes, path>`).

    Resources: `num_gpus` encoder actors with one GPU each (default: every GPU in the cluster); with
    no GPUs, `num_actors` CPU actors (default 1). `batch_size` is rows per encoder batch; by default
    it is about two of the largest bucket's worth of patches at `typical_patches` per image (sampled
    from the first rows when not given, which runs the head of `ds` once). Decoding runs as tasks of
    `decode_batch_size` rows, `decode_cpus` each, at most `decode_concurrency` at once.
    """
    import ray.data

    pooling = resolve_pooling(pooling, model)
    if decode_batch_size < 1:
        raise InvalidArgumentError(f"decode_batch_size must be >= 1, got {decode_batch_size}")
    pp = preprocess_config_for(model)  # also validates the model name / directory up front
    schema = ds.schema(fetch_if_missing=False)
    if schema is not None and image_column not in schema.names:
        raise InvalidArgumentError(f"no column {image_column!r} in the input; columns: {', '.join(schema.names)}")
    gpus = gpus_in_cluster() if num_gpus is None else int(num_gpus)
    device = actor_device(gpus)
    plan = actor_plan(model, device, buckets, actor_graph_cap(model, device, dtype, attention))
    root = str(Path.cwd()) if path_root is None else str(path_root)
    if batch_size is None:
        if typical_patches is None:
            sample = ds.select_columns([image_column]).limit(32).take_batch(32, batch_format="pyarrow")
            kind = image_column_kind(sample.schema.field(image_column).type)
            typical_patches = typical_patches_of(sample.column(image_column).to_pylist(), kind, pp, root)
        batch_size = rows_per_batch(plan, typical_patches)
    if batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")

    decode_compute = ray.data.TaskPoolStrategy(size=decode_concurrency) if decode_concurrency else None
    # Small blocks so decoding spreads over many tasks; then blocks of exactly one encoder batch. The
    # strict repartition is its own stage, which also keeps Ray Data from fusing the decode tasks into
    # the encoder actors (it would when both ask for the same resources, e.g. on a CPU-only cluster).
    ds = ds.repartition(target_num_rows_per_block=decode_batch_size, strict=True)
    ds = ds.map_batches(
        decode_batch,
        batch_format="pyarrow",
        batch_size=None,
        fn_kwargs={"image_column": image_column, "pp": pp, "path_root": root},
        num_cpus=decode_cpus,
        compute=decode_compute,
        udf_modifying_row_count=False,
    )
    ds = ds.repartition(target_num_rows_per_block=batch_size, strict=True)
    actors = max(1, gpus) if gpus > 0 else max(1, int(num_actors or 1))
    return ds.map_batches(
        EncoderActor,
        batch_format="pyarrow",
        batch_size=batch_size,
        fn_constructor_kwargs={
            "model": model,
            "pooling": pooling,
            "buckets": buckets,
            "dtype": dtype,
            "attention": attention,
            "preprocess_config": pp,
            "expected_table": plan.table,
        },
        compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=2),
        num_gpus=1 if gpus > 0 else 0,
        num_cpus=actor_cpus,
        udf_modifying_row_count=False,
    )
