"""The encode stage of a batch job: `EncoderActor`, a Ray Data callable class (one per GPU, or CPU worker).

The actor builds a `workspace.GraphEncoder` in its constructor (CUDA graphs captured there, once per
actor, before its first batch), normalises and patchifies the uint8 pixels on its device, orders each
batch so the runner's packs fill the largest bucket (first-fit decreasing), runs it and adds the
`embedding` column (with `pooling="none"`, the LLM-ready outputs of `GraphEncoder.encode_llm`: tokens,
patch grid and DeepStack features, and a video job's timestamps or second_per_grid_ts from its decode stage;
layout in `deployments.batch.columns`).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import torch

import encoder
from deployments.batch.columns import (
    DEEPSTACK,
    EC_CACHE,
    EMBEDDING,
    ERROR,
    FRAMES,
    GRID_H,
    GRID_T,
    GRID_THW,
    GRID_W,
    HEIGHT,
    INTERNAL,
    NUM_TOKENS,
    PATCHES,
    PER_GRID,
    PIXELS,
    SECOND_PER_GRID_TS,
    STAMPS,
    STAMPS_TYPE,
    TIMESTAMPS,
    WIDTH,
    fixed_size_list,
    lists,
    vectors,
)  # fmt: skip
from deployments.batch.decode import describe_error
from deployments.batch.model_facts import config_for, deepstack_layers, resolve_pooling
from deployments.errors import RequestError
from deployments.llm_outputs import to_wire
from deployments.vllm_handoff import check_uuid, check_vllm_model, write_ec_cache
from encoder.attention import graph_token_cap
from encoder.errors import InvalidArgumentError
from encoder.patch_batch import PatchBatch
from encoder.patchify import patchify, patchify_video
from encoder.preprocessing.config import ProcessorConfig
from workspace.buckets import BucketKey, BucketTable
from workspace.graph_encoder import GraphEncoder
from workspace.tables import process_plan, shape_of_encoder


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
        quantization: str | None = None,
        preprocess_config: ProcessorConfig | None = None,
        expected_table: BucketTable | None = None,
        layout: str = "parts",
        ec_cache_dir: str | None = None,
        uuid_column: str | None = None,
    ):
        start = time.perf_counter()
        self.vllm = layout == "vllm" or ec_cache_dir is not None
        if self.vllm:
            check_vllm_model(config_for(model).family, model, "layout")
            pooling = "none" if pooling is None else pooling
        self.pooling = resolve_pooling(pooling, model)
        if self.vllm and self.pooling != "none":
            raise InvalidArgumentError(f"the vLLM layout is of the per-token outputs, not pooling {self.pooling!r}")
        self.ec_cache_dir, self.uuid_column = ec_cache_dir, uuid_column
        # the driver warned once that a preset's weights are random (`embed_dataset`), and the ready line below marks
        # them; every actor repeating it in warnings' file:line form is noise. The actor's process is its own
        warnings.filterwarnings("ignore", category=encoder.RandomWeightsWarning)
        # images only (no text column yet): no text weights on the GPU
        self.vision = encoder.load(model, dtype=dtype, attention=attention, quantization=quantization, text=False)
        if preprocess_config is not None and preprocess_config != self.vision.preprocess_config:
            raise InvalidArgumentError("the decode stage's preprocessing differs from the model's (driver/actor drift)")
        self.pp = self.vision.preprocess_config
        self.plan = process_plan(
            shape_of_encoder(self.vision), self.vision.device.type, buckets,
            max_graph_tokens=graph_token_cap(self.vision.model.backends),
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
        # the files for vLLM's disk connector: in the tower's own dtype, as vLLM's encoder would store them
        self.ec_dtype = str(self.vision.dtype).removeprefix("torch.")
        stats = self.engine.stats()
        weights = " (RANDOM weights)" if self.vision.random_weights else ""
        fp8 = f", {self.vision.quantization} block linears" if self.vision.quantization else ""
        print(
            f"[deployments.batch] encoder {self.vision.name}{weights} on {self.device} ({self.vision.dtype}{fp8}): "
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
        # a video job's rows: their sampled frames (`decode.decode_video_batch`); 0 for an image
        frames = table.column(FRAMES).to_numpy(zero_copy_only=False) if FRAMES in table.column_names else None
        results: dict[int, torch.Tensor] = {}
        if ok:
            rows = _pixel_rows(table.column(PIXELS), self.device)

            def image(i: int) -> torch.Tensor:
                if frames is not None and frames[i]:
                    return rows[i].view(int(frames[i]), int(heights[i]), int(widths[i]), 3)
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
            first = image(order[start])
            if first.dim() == 4:  # a video's frames: its own patchify (`patchify_video`), its grid t > 1
                vcfg = self.vision.video_config
                parts.append(patchify_video(first, vcfg))
                t = -(-first.shape[0] // vcfg.temporal_patch_size)
                grid.append((t, int(size[0]) // p, int(size[1]) // p))
                start = end
                continue
            while end < len(order) and (heights[order[end]], widths[order[end]]) == size:
                if image(order[end]).dim() == 4:  # a video ends the run of images
                    break
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
                    errors[i] = f"encode failed: {describe_error(exc)}"
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
            out = out.append_column(EMBEDDING, fixed_size_list(values, self.dim, ~valid))
        else:  # LLM-ready outputs (layout: the module docstring)
            if self.ec_cache_dir is not None:
                paths = self._write_ec_cache(table, results, errors)
                valid = np.array([i in results for i in range(n)], dtype=bool)
            rows = [i for i in range(n) if i in results]
            grid = np.zeros((n, 3), dtype=np.int32)
            for i in rows:
                grid[i] = results[i].grid_thw
            tokens = np.zeros(n, dtype=np.int64)
            tokens[rows] = [len(results[i].tokens) for i in rows]
            if self.ec_cache_dir is not None:
                out = out.append_column(EC_CACHE, pa.array(paths, type=pa.string()))
            elif self.vllm:  # vLLM's one tensor per image: tokens ++ DeepStack layers on the last axis
                width = self.dim * (1 + self.deepstack_layers)
                whole = vectors([results[i].vllm_embeds().numpy() for i in rows], width)
                out = out.append_column(EMBEDDING, lists(tokens.tolist(), whole, valid))
            else:
                token_vectors = vectors([results[i].tokens.numpy() for i in rows], self.dim)
                out = out.append_column(EMBEDDING, lists(tokens.tolist(), token_vectors, valid))
            out = out.append_column(NUM_TOKENS, pa.array(tokens, type=pa.int32()))
            out = out.append_column(GRID_T, pa.array(grid[:, 0], type=pa.int32()))
            out = out.append_column(GRID_H, pa.array(grid[:, 1], type=pa.int32()))
            out = out.append_column(GRID_W, pa.array(grid[:, 2], type=pa.int32()))
            mask = pa.array(~valid) if not valid.all() else None
            out = out.append_column(
                GRID_THW, pa.FixedSizeListArray.from_arrays(pa.array(grid.reshape(-1)), 3, mask=mask)
            )
            if STAMPS in table.column_names:  # a video job: each video's facts, as its decode task found them
                stamps, per_grid = table.column(STAMPS).to_pylist(), table.column(PER_GRID).to_pylist()
                kept = [stamps[i] if valid[i] else None for i in range(n)]
                out = out.append_column(TIMESTAMPS, pa.array(kept, type=STAMPS_TYPE))
                kept = [per_grid[i] if valid[i] else None for i in range(n)]
                out = out.append_column(SECOND_PER_GRID_TS, pa.array(kept, type=pa.float32()))
            if self.deepstack_layers and not self.vllm:
                k = self.deepstack_layers
                if any(len(results[i].deepstack) != k for i in rows):
                    raise RuntimeError(f"the engine returned DeepStack layers other than the config's {k}")
                layers = vectors([d.numpy() for i in rows for d in results[i].deepstack], self.dim)
                per_layer = lists([int(tokens[i]) for i in rows for _ in range(k)], layers)  # a list per (row, layer)
                out = out.append_column(DEEPSTACK, lists([k if valid[i] else 0 for i in range(n)], per_layer, valid))
        return out.append_column(ERROR, pa.array(errors, type=pa.string()))

    def _write_ec_cache(self, table: pa.Table, results: dict[int, Any], errors: list) -> list[str | None]:
        """Each encoded row's vLLM-layout tensor written as `<ec_cache_dir>/<uuid>/encoder_cache.safetensors`;
        the paths (None for error rows). A missing or unsafe uuid makes its row an error row (and drops its
        result); a failed write fails the job (the disk, not the data)."""
        if self.uuid_column not in table.column_names:
            raise InvalidArgumentError(f"no uuid column {self.uuid_column!r} in the input")
        uuids = table.column(self.uuid_column).to_pylist()
        paths: list[str | None] = [None] * table.num_rows
        for i in sorted(results):
            try:
                uuid = check_uuid(uuids[i], f"{self.uuid_column}")
            except RequestError as exc:
                errors[i] = f"ec_cache: {exc}"
                del results[i]
                continue
            wire = to_wire(results[i].vllm_embeds(), self.ec_dtype)
            paths[i] = write_ec_cache(self.ec_cache_dir, uuid, wire, self.ec_dtype)
        return paths
