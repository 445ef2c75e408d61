"""Resized uint8 images -> patches in the packed layout the towers consume (torch).

Kept apart from `encoder.preprocessing` (decoding and resizing: Pillow and numpy only) so that the processes which
only decode and check images (ingress replicas, their decode workers) never import torch.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from encoder.errors import EncoderError, ImageDecodeError, InvalidImageError, InvalidVideoError
from encoder.patch_batch import PatchBatch
from encoder.preprocessing.config import ProcessorConfig
from encoder.preprocessing.images import load_image
from encoder.preprocessing.qwen import DEFAULT_CONFIG


@lru_cache(maxsize=32)
def _normalise_lut(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """[3*256] float32: normalised value of byte v in channel c at index c*256+v.

    Built with transformers' arithmetic (v * (1/255) in float64, cast to float32, then float32
    (x - mean) / std), so a gather reproduces its output bit for bit on any device.
    """
    scaled = (torch.arange(256, dtype=torch.float64) * (1 / 255)).to(torch.float32)
    m = torch.tensor(mean, dtype=torch.float32)[:, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None]
    return ((scaled[None, :] - m) / s).reshape(-1).to(device)


def patchify(pixels: torch.Tensor, cfg: ProcessorConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """uint8 [H, W, 3] (sides multiples of P*m) -> float32 [(H/P)*(W/P), 3*T*P*P] on the same device.

    Rows are ordered by merge block (row-major), then within a block; columns are (C, T, P, P), or
    (P, P, C) for a config whose `channels_last` is true (SigLIP2 NaFlex; T = m = 1 there).
    """
    if isinstance(pixels, np.ndarray):
        pixels = torch.from_numpy(pixels)
    _check_pixels(pixels, cfg)
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, _ = pixels.shape
    gh, gw = height // p, width // p
    lut = _normalise_lut(cfg.image_mean, cfg.image_std, pixels.device)
    channel_offset = torch.arange(3, device=pixels.device) * 256
    values = lut[pixels.long() + channel_offset]  # [H, W, 3] float32
    if cfg.channels_last:  # (row, col, py, px, C), as transformers' NaFlex processor
        return values.view(gh, p, gw, p, 3).permute(0, 2, 1, 3, 4).reshape(gh * gw, cfg.patch_dim)
    blocks = values.view(gh // m, m, p, gw // m, m, p, 3).permute(0, 3, 1, 4, 6, 2, 5)
    # -> (block row, block col, row in block, col in block, C, py, px); a still image fills all T frames.
    frames = blocks.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
    return frames.reshape(gh * gw, cfg.patch_dim)


@lru_cache(maxsize=32)
def _video_lut(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """[3*256] float32: the normalised value of byte v in channel c as transformers' video processors compute it
    (`rescale_and_normalize` fused: the uint8 frame cast to float32, minus mean * 255, over std * 255, each
    product and step in float32), so a gather reproduces `pixel_values_videos` bit for bit."""
    values = torch.arange(256, dtype=torch.float32)
    m = (torch.tensor(mean, dtype=torch.float32) * (1.0 / (1 / 255)))[:, None]
    s = (torch.tensor(std, dtype=torch.float32) * (1.0 / (1 / 255)))[:, None]
    return ((values[None, :] - m) / s).reshape(-1).to(device)


def patchify_video(frames: torch.Tensor, cfg) -> torch.Tensor:
    """uint8 [n, H, W, 3] sampled, resized frames (sides multiples of P*m) -> float32 [t*(H/P)*(W/P), 3*T*P*P] in
    the Hugging Face video order: an n not a multiple of T padded by repeating the last frame (as transformers
    does), rows by temporal patch, then merge block (row-major), then within a block; columns (C, T, P, P).
    `cfg` is an `encoder.preprocessing.video.VideoPreprocessConfig`."""
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(frames)
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[3] != 3 or frames.shape[0] == 0:
        got = f"{frames.dtype} {tuple(frames.shape)}"
        raise InvalidImageError(f"patchify_video expects uint8 [frames, H, W, 3], got {got}")
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    n, height, width, _ = frames.shape
    if height % cfg.factor or width % cfg.factor:
        raise InvalidImageError(f"patchify_video needs sides that are multiples of {cfg.factor}; got {height}x{width}")
    if pad := -n % t:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = frames.shape[0] // t, height // p, width // p
    lut = _video_lut(tuple(cfg.image_mean), tuple(cfg.image_std), frames.device)
    values = lut[frames.long() + torch.arange(3, device=frames.device) * 256]  # [n, H, W, 3] float32
    blocks = values.view(gt, t, gh // m, m, p, gw // m, m, p, 3)
    # -> (temporal patch, block row, block col, row in block, col in block, C, frame in patch, py, px)
    return blocks.permute(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(gt * gh * gw, cfg.patch_dim)


def _check_pixels(pixels: torch.Tensor, cfg: ProcessorConfig) -> None:
    if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8:
        got = getattr(pixels, "dtype", type(pixels).__name__)
        raise InvalidImageError(f"patchify expects a uint8 tensor, got {got}")
    if pixels.dim() != 3 or pixels.shape[2] != 3:
        raise InvalidImageError(f"patchify expects shape [H, W, 3], got {tuple(pixels.shape)}")
    h, w, _ = pixels.shape
    if h == 0 or w == 0 or h % cfg.factor or w % cfg.factor:
        raise InvalidImageError(f"patchify needs non-zero sides, multiples of {cfg.factor}; got {h}x{w}")


def patchify_many(pixels: list[torch.Tensor], cfg: ProcessorConfig = DEFAULT_CONFIG) -> PatchBatch:
    """Patchify several uint8 images and concatenate; grid_thw is int64 on the CPU (host metadata)."""
    patches = [patchify(x, cfg) for x in pixels]
    sizes = [(1, x.shape[0] // cfg.patch_size, x.shape[1] // cfg.patch_size) for x in pixels]
    grid = torch.tensor(sizes, dtype=torch.int64).reshape(-1, 3)
    return PatchBatch(torch.cat(patches) if patches else torch.zeros(0, cfg.patch_dim), grid)


def upload(arrays: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Arrays of one width, stacked vertically, on `device` with one copy. On CUDA the stack is written into
    pinned memory and uploaded asynchronously: a pageable upload would wait for the replays already queued,
    so the next batch's upload could not overlap the running one."""
    device = torch.device(device)
    rows = sum(a.shape[0] for a in arrays)
    host = torch.empty((rows, *arrays[0].shape[1:]), dtype=torch.uint8, pin_memory=device.type == "cuda")
    np.concatenate(arrays, axis=0, out=host.numpy())
    return host.to(device, non_blocking=True)


def stack_patchify(arrays: list[np.ndarray], cfg: ProcessorConfig, device: torch.device, video_cfg=None) -> PatchBatch:
    """Upload and patchify on `device`; consecutive images of equal width go through one `patchify`.

    Stacking images vertically keeps each image's merge blocks contiguous and in order (its block rows
    come before the next image's), so one call equals the concatenation of per-image calls. With `video_cfg`
    (an `encoder.preprocessing.video.VideoPreprocessConfig`), uint8 [n, h, w, 3] arrays among them are videos'
    sampled, resized frames: each goes through `patchify_video` (its grid row t > 1), in the items' order.
    """
    if video_cfg is not None and any(a.ndim == 4 for a in arrays):
        parts, grids, i = [], [], 0
        while i < len(arrays):
            if arrays[i].ndim == 4:
                frames = arrays[i]
                parts.append(patchify_video(upload([frames], device), video_cfg))
                t = -(-frames.shape[0] // video_cfg.temporal_patch_size)
                grids.append(torch.tensor([[t, frames.shape[1] // video_cfg.patch_size,
                                            frames.shape[2] // video_cfg.patch_size]]))  # fmt: skip
                i += 1
                continue
            j = i
            while j < len(arrays) and arrays[j].ndim != 4:
                j += 1
            images = stack_patchify(arrays[i:j], cfg, device)
            parts.append(images.pixel_values)
            grids.append(images.grid_thw)
            i = j
        return PatchBatch(torch.cat(parts), torch.cat(grids).to(torch.int64))
    parts, start = [], 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and arrays[end].shape[1] == arrays[start].shape[1]:
            end += 1
        parts.append(patchify(upload(arrays[start:end], device), cfg))
        start = end
    grid = torch.tensor([[1, a.shape[0] // cfg.patch_size, a.shape[1] // cfg.patch_size] for a in arrays])
    return PatchBatch(parts[0] if len(parts) == 1 else torch.cat(parts), grid)


def preprocess(images: Any, cfg: ProcessorConfig = DEFAULT_CONFIG) -> PatchBatch:
    """One input or a list of inputs (any kind `load_image` accepts) -> PatchBatch, equal to HF's output.

    The family's resize rule is the config's (`cfg.resize`: Qwen's smart resize, CLIP / SigLIP's resize and
    crop, whose grid_thw rows are (1, H/P, W/P)).
    """
    items = list(images) if isinstance(images, list | tuple) else [images]
    arrays = []
    for i, x in enumerate(items):
        try:
            arrays.append(torch.from_numpy(cfg.resize(load_image(x, cfg))))
        except (ImageDecodeError, InvalidImageError) as e:
            if len(items) == 1:
                raise
            raise type(e)(f"image {i}: {e}") from e
    return patchify_many(arrays, cfg)


def preprocess_videos(videos: Any, cfg, fps: float | None = None) -> PatchBatch:
    """One video or a list (encoded bytes, or uint8 arrays [frames, H, W, 3] of every frame at `fps`) -> a
    PatchBatch equal to the transformers video processor's `pixel_values_videos` / `video_grid_thw` (`cfg`: an
    `encoder.preprocessing.video.VideoPreprocessConfig`), with the timestamps for Qwen3-VL and the seconds per
    temporal patch (`second_per_grid_ts`) for Qwen2/2.5-VL."""
    from encoder.preprocessing.video import prepare_frames
    from encoder.preprocessing.video_decode import load_video

    items = list(videos) if isinstance(videos, list | tuple) else [videos]
    patches, grids, stamps, per_grid = [], [], [], []
    for i, x in enumerate(items):
        try:
            if isinstance(x, bytes | bytearray | memoryview):
                prepared = load_video(bytes(x), cfg)
            elif isinstance(x, np.ndarray):
                prepared = prepare_frames(x, fps, cfg)
            else:
                raise InvalidVideoError(
                    f"unsupported video type {type(x).__name__}; expected encoded bytes, a path or a uint8 array "
                    "[frames, height, width, 3]"
                )
        except EncoderError as e:
            if len(items) == 1:
                raise
            raise type(e)(f"video {i}: {e}") from e
        frames = prepared.frames
        patches.append(patchify_video(frames, cfg))
        t = -(-frames.shape[0] // cfg.temporal_patch_size)
        grids.append((t, frames.shape[1] // cfg.patch_size, frames.shape[2] // cfg.patch_size))
        stamps.append(prepared.timestamps)
        per_grid.append(prepared.second_per_grid_ts)
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    pv = torch.cat(patches) if patches else torch.zeros(0, cfg.patch_dim)
    return PatchBatch(
        pv,
        grid,
        stamps if any(s is not None for s in stamps) else None,
        per_grid if any(s is not None for s in per_grid) else None,
    )
