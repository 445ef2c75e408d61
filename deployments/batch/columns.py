"""The columns of a batch job: internal ones between its stages, the output's, and their Arrow types.

Output columns with `pooling="none"` (one row per image; every column null or 0 on error rows):
  * `embedding`: `list<fixed_size_list<float32>[out_dim]>`, the merger's tokens in order (row-major over
    the (grid_h / m) x (grid_w / m) token grid, m = `spatial_merge_size`), what replaces the image's
    placeholder tokens in the LLM.
  * `num_tokens`, `grid_t`, `grid_h`, `grid_w`: `int32`, the tokens and the patch grid = the Hugging Face
    processor's `image_grid_thw` row, which the LLM's M-RoPE positions are computed from
    (`num_tokens = grid_t * grid_h * grid_w / m**2`; `grid_t` is 1 for images).
  * `grid_thw`: `fixed_size_list<int32>[3]`, the same patch grid as one value `[grid_t, grid_h, grid_w]`.
  * `deepstack` (DeepStack models only, e.g. Qwen3-VL): `list<list<fixed_size_list<float32>[out_dim]>>`,
    `deepstack[k][t]` = DeepStack layer k's feature of token t, layers in block order (the blocks of
    `deepstack_visual_indexes`, ascending, as transformers emits them); the LLM adds layer k's features at
    the image positions after decoder layer k.
  * `timestamps`, `second_per_grid_ts` (video jobs only, after `grid_thw`; `deployments.llm_outputs.VIDEO_FACTS`): a
    Qwen3-VL video's seconds of each temporal patch (`list<float32>`, `grid_t` values, its prompt's `<t seconds>`)
    and a Qwen2/2.5-VL video's seconds one temporal patch spans (`float32`, Qwen2.5-VL's M-RoPE spacing), as
    `VisionEncoder.preprocess_video` gives them; null where the tower has no such fact and on error rows.

With the vLLM layout (`layout="vllm"`, Qwen towers) `embedding` is `list<fixed_size_list<float32>[out_dim * (1 +
L)]>`: per token its L + 1 parts (the token, then each DeepStack layer in model order) concatenated, the tensor
vLLM's Qwen models produce and take as `image_embeds`; no `deepstack` column. With `ec_cache_dir` the tensor is
written for vLLM's disk connector instead of `embedding` (`deployments.vllm_handoff.write_ec_cache`), and
`ec_cache` (string) is the file's path. A video job's `timestamps` and `second_per_grid_ts` are written in every
layout (with the grid, they are what the LLM needs beside the tensor).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from deployments.llm_outputs import VIDEO_FACTS

# Internal columns between the stages; never in the output.
PIXELS = "_ve_pixels"  # large_binary: uint8 H*W*3, row-major RGB, at the model's size
HEIGHT = "_ve_height"  # int32: resized height (multiple of patch_size * merge_size)
WIDTH = "_ve_width"  # int32
PATCHES = "_ve_patches"  # int32: patches (grid t*h*w) of the resized image; 0 for error rows
FRAMES = "_ve_frames"  # int32, video jobs only: the sampled frames in PIXELS (n*H*W*3); 0 for error rows
# video jobs only, from the video's preprocessing (`PreparedVideo`); null for error rows and towers without them
STAMPS = "_ve_timestamps"  # list<float32>: seconds of each temporal patch (Qwen3-VL)
PER_GRID = "_ve_second_per_grid_ts"  # float32: seconds one temporal patch spans (Qwen2/2.5-VL)
INTERNAL = (PIXELS, HEIGHT, WIDTH, PATCHES, FRAMES, STAMPS, PER_GRID)

# Output columns.
EMBEDDING = "embedding"
ERROR = "error"
NUM_TOKENS = "num_tokens"
GRID_T = "grid_t"
GRID_H = "grid_h"
GRID_W = "grid_w"
GRID_THW = "grid_thw"
DEEPSTACK = "deepstack"
EC_CACHE = "ec_cache"
OUTPUT_COLUMNS = (EMBEDDING, ERROR, NUM_TOKENS, GRID_T, GRID_H, GRID_W, GRID_THW, DEEPSTACK, EC_CACHE)
# a video job's per-token outputs also carry the video's facts, named as the service's LLM answers name them
TIMESTAMPS, SECOND_PER_GRID_TS = VIDEO_FACTS
VIDEO_COLUMNS = (TIMESTAMPS, SECOND_PER_GRID_TS)
STAMPS_TYPE = pa.list_(pa.float32())


def output_schema(
    input_schema: pa.Schema,
    image_column: str,
    pooling: str,
    dim: int,
    deepstack_layers: int = 0,
    layout: str = "parts",
    ec_cache: bool = False,
    video: bool = False,
) -> pa.Schema:
    """The schema `embed_dataset` produces for an input schema (documented layout in the module docstring);
    `deepstack_layers` (pooling="none"): the model's DeepStack layers (`deepstack_layers(config)`); `layout`
    "vllm": them concatenated to the tokens; `ec_cache`: files written, an `ec_cache` path column for them;
    `video` (a `video_column` job): with pooling="none", the `timestamps` and `second_per_grid_ts` columns."""
    fields = [f for f in input_schema if f.name != image_column]
    vllm = layout == "vllm" or ec_cache
    vector = pa.list_(pa.float32(), dim * (1 + deepstack_layers) if vllm else dim)
    if pooling != "none":
        fields.append(pa.field(EMBEDDING, vector))
    else:
        fields += [
            pa.field(EC_CACHE, pa.string()) if ec_cache else pa.field(EMBEDDING, pa.list_(vector)),
            pa.field(NUM_TOKENS, pa.int32()),
            pa.field(GRID_T, pa.int32()),
            pa.field(GRID_H, pa.int32()),
            pa.field(GRID_W, pa.int32()),
            pa.field(GRID_THW, pa.list_(pa.int32(), 3)),
        ]
        if video:  # after the grid, as in the service's answers
            fields += [pa.field(TIMESTAMPS, STAMPS_TYPE), pa.field(SECOND_PER_GRID_TS, pa.float32())]
        if deepstack_layers and not vllm:
            fields.append(pa.field(DEEPSTACK, pa.list_(pa.list_(vector))))
    return pa.schema([*fields, pa.field(ERROR, pa.string())])


def fixed_size_list(values: np.ndarray, dim: int, null_mask: np.ndarray | None) -> pa.Array:
    flat = pa.array(values.reshape(-1), type=pa.float32())
    mask = pa.array(null_mask) if null_mask is not None and null_mask.any() else None
    return pa.FixedSizeListArray.from_arrays(flat, dim, mask=mask)


def vectors(arrays: list[np.ndarray], dim: int) -> pa.Array:
    """`fixed_size_list<float32>[dim]` of the rows of [n_i, dim] arrays, in order (one concatenation)."""
    values = np.concatenate(arrays) if arrays else np.zeros((0, dim), dtype=np.float32)
    return fixed_size_list(values, dim, None)


def lists(sizes: list[int], inner: pa.Array, valid: np.ndarray | None = None) -> pa.Array:
    """A list array over `inner`, `sizes[i]` items in list i; null where not `valid`."""
    offsets = np.zeros(len(sizes) + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    mask = pa.array(~valid) if valid is not None and not valid.all() else None
    return pa.ListArray.from_arrays(pa.array(offsets), inner, mask=mask)
