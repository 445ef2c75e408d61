"""Video preprocessing for the Qwen towers, equal to transformers' video processors given the same decoded frames
(numpy, no torch): the settings (`VideoPreprocessConfig`, also read from a checkpoint's video processor file), frame
sampling, the resize rule, and Qwen3-VL's per-frame timestamps.

    decode (`encoder.preprocessing.video_decode.decode_video`: bytes -> sampled uint8 frames) or an array
    ->  prepare_frames (sample, resize: uint8 [n, h, w, 3] and the timestamps)
    ->  `encoder.patchify.patchify_video` (torch: an odd frame count padded with the last frame, normalised,
        patches in the Hugging Face order)

Two rule sets, by `kind` (transformers 5.17, `models/qwen2_vl/video_processing_qwen2_vl.py` and
`models/qwen3_vl/video_processing_qwen3_vl.py`):
  * "qwen2" (`Qwen2VLVideoProcessor`; Qwen2-VL, Qwen2.5-VL): frames sampled only when `do_sample_frames` (default
    off: every frame given is used); with `num_frames`, rounded to a multiple of `temporal_patch_size`; with
    `fps`, `total / video_fps * fps` within [min_frames, min(max_frames, total) floored to the multiple], floored
    to the multiple; indices `torch.arange(0, total, total / n).int()` (float32 values, truncated). The size is
    the image rule's `smart_resize` of one frame.
  * "qwen3" (`Qwen3VLVideoProcessor`; Qwen3-VL, Qwen3.5): sampling on by default at 2 fps; `int(total /
    video_fps * fps)` within [min_frames, min(max_frames, total)]; indices `linspace(0, total - 1, n).round()`.
    The size is Qwen3's `smart_resize` over all n frames (frames smaller than the factor scaled up first; the
    pixel budget counts the frames rounded to the temporal factor). A video with fewer than
    `temporal_patch_size` frames is refused, as transformers refuses it.
  * Both: the resize is torch's antialiased bicubic on uint8 (`encoder.preprocessing.resample`, what
    torchvision does on a CPU tensor), `cap_pixels_per_frame` as transformers computes it (off unless the file
    sets it, as transformers' current default), rescale and normalise in float32 after the resize.
  * Timestamps (Qwen3-VL's prompt, `Qwen3VLProcessor._calculate_timestamps`): the sampled indices padded with the
    last to a multiple of `temporal_patch_size`, each group's first and last index over the video's fps, averaged.
    A video given as frames without its fps is taken at 24 fps, as transformers does.
  * Seconds per temporal patch (Qwen2.5-VL's `second_per_grid_ts`, which spaces the temporal M-RoPE positions of
    a video: `Qwen2_5_VLProcessor._process_videos`, transformers 5.25): `temporal_patch_size` over the sampled
    frame rate (`VideoMetadata.sampled_fps`: sampled frames / all frames x the video's fps; 24 when the fps is
    unknown).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from encoder.errors import ConfigError, InvalidArgumentError, InvalidVideoError, VideoTooLargeError, validation_reason
from encoder.preprocessing.config import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PatchSizes,
    reject_unsupported_steps,
    std_positive,
)
from encoder.preprocessing.qwen import smart_resize as image_smart_resize
from encoder.preprocessing.resample import resize_frames

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
DEFAULT_FPS = 24.0  # transformers' Qwen3-VL sampling and timestamps when a video's fps is unknown
BICUBIC = 3


class VideoLimits(BaseModel):
    """Limits on one video, checked from the container's header before frames are decoded where it can tell, and
    while decoding where it cannot (`encoder.preprocessing.video_decode`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_bytes: int = Field(256 * 2**20, gt=0, description="Encoded size.")
    max_duration_s: float = Field(600.0, gt=0, description="Duration (frames / frame rate, and the header's).")
    max_frames: int = Field(18_000, gt=0, description="Frames in the stream (10 minutes at 30 fps).")
    max_fps: float = Field(1000.0, gt=0, description="Frame rate the stream declares.")
    max_frame_pixels: int = Field(3840 * 2160, gt=0, description="Width x height of one frame (4K UHD).")
    max_kept_pixels: int = Field(
        400_000_000, gt=0, description="Width x height x sampled frames held decoded at once (1.2 GB of RGB)."
    )
    max_decode_s: float = Field(60.0, gt=0, description="Wall time of the decode, checked after each frame.")


DEFAULT_VIDEO_LIMITS = VideoLimits()


class VideoPreprocessConfig(PatchSizes, BaseModel):
    """A Qwen video processor's settings; `defaults(kind)` are transformers' class defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["qwen2", "qwen3"] = Field(description="The rule set: Qwen2VLVideoProcessor or Qwen3VLVideoProcessor.")
    min_pixels: int = Field(gt=0, description="size.shortest_edge: lower bound on resized pixels.")
    max_pixels: int = Field(gt=0, description="size.longest_edge: upper bound (qwen3: over all frames).")
    patch_size: int = Field(gt=0)
    temporal_patch_size: int = Field(2, gt=0)
    merge_size: int = Field(2, gt=0)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_sample_frames: bool
    fps: float | None = Field(None, gt=0, description="Frames per second sampled.")
    num_frames: int | None = Field(None, gt=0, description="Frames sampled (instead of fps).")
    min_frames: int = Field(4, gt=0)
    max_frames: int = Field(768, gt=0)
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = Field(gt=0)
    limits: VideoLimits = DEFAULT_VIDEO_LIMITS

    @field_validator("image_std")
    @classmethod
    def _std_positive(cls, v):
        return std_positive(v)

    @model_validator(mode="after")
    def _check(self) -> VideoPreprocessConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        if self.fps is not None and self.num_frames is not None and self.do_sample_frames:
            raise ValueError("fps and num_frames are mutually exclusive")
        return self

    @classmethod
    def defaults(cls, kind: str, **overrides: Any) -> VideoPreprocessConfig:
        """transformers' class defaults of `Qwen2VLVideoProcessor` ("qwen2") or `Qwen3VLVideoProcessor` ("qwen3")."""
        if kind == "qwen2":
            base = dict(
                min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, patch_size=14, image_mean=OPENAI_CLIP_MEAN,
                image_std=OPENAI_CLIP_STD, do_sample_frames=False, fps=None, max_video_tokens=128000,
            )  # fmt: skip
        else:
            base = dict(
                min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, patch_size=16, image_mean=IMAGENET_STANDARD,
                image_std=IMAGENET_STANDARD, do_sample_frames=True, fps=2.0, max_video_tokens=768,
            )  # fmt: skip
        try:
            return cls(kind=kind, **(base | overrides))
        except ValidationError as e:
            raise ConfigError(f"invalid video processor config: {validation_reason(e)}") from e

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], kind: str, **overrides: Any) -> VideoPreprocessConfig:
        """From a video processor's JSON (or, as transformers falls back, the image processor's): the class
        defaults with the file's values over them. Qwen2 takes top-level `min_pixels` / `max_pixels` over `size`
        (its `__init__` does); Qwen3 reads `size` only. Switches we cannot honour raise ConfigError."""
        reject_unsupported_steps(d)
        if d.get("resample") not in (None, BICUBIC):
            raise ConfigError(f"unsupported resample {d['resample']} (only 3 = bicubic)")
        size = d.get("size") or {}
        if not isinstance(size, dict):
            raise ConfigError(f"video processor config 'size' must be a dict, got {size!r}")
        picks: dict[str, Any] = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
        if kind == "qwen2":
            for key in ("min_pixels", "max_pixels"):
                if d.get(key) is not None:
                    picks[key] = d[key]
        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "do_sample_frames", "fps",
                "num_frames", "min_frames", "max_frames", "cap_pixels_per_frame", "max_video_tokens")  # fmt: skip
        for key in keys:
            picks[key] = d.get(key)
        for key in ("image_mean", "image_std"):  # one number for every channel
            if isinstance(picks[key], int | float) and not isinstance(picks[key], bool):
                picks[key] = (picks[key],) * 3
        return cls.defaults(kind, **({k: v for k, v in picks.items() if v is not None} | overrides))

    # -- sampling ---------------------------------------------------------------------------------------
    def sample_indices(self, total: int, video_fps: float | None) -> np.ndarray:
        """Indices of the frames used out of `total` (the video processor's `sample_frames`)."""
        if total <= 0:
            raise InvalidVideoError("video has no frames")
        if not self.do_sample_frames:
            return np.arange(total)
        return _sample_qwen2(self, total, video_fps) if self.kind == "qwen2" else _sample_qwen3(self, total, video_fps)

    # -- sizes ------------------------------------------------------------------------------------------
    def target_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every one of `frames` sampled frames of `height` x `width` is resized to."""
        if frames <= 0 or height <= 0 or width <= 0:
            raise InvalidVideoError(f"video has zero size ({frames} frames of {width}x{height})")
        factor, tps = self.factor, self.temporal_patch_size
        max_pixels = self.max_pixels
        if self.kind == "qwen2":
            if self.cap_pixels_per_frame:
                total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
                max_pixels = max(min(max_pixels, total_pixels * tps // frames), int(self.min_pixels * 1.05))
            return image_smart_resize(height, width, factor, self.min_pixels, max_pixels)
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(min(frame_cap, self.max_pixels // frames), int(self.min_pixels * 1.05))
            max_pixels = per_frame * frames
        return qwen3_smart_resize(frames, height, width, tps, factor, self.min_pixels, max_pixels)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches of `frames` sampled frames of `height` x `width` (an odd count is padded)."""
        h, w = self.target_size(frames, height, width)
        return -(-frames // self.temporal_patch_size), h // self.patch_size, w // self.patch_size

    def timestamps(self, indices: np.ndarray | list[int], video_fps: float | None) -> list[float]:
        """Seconds of each temporal patch (Qwen3-VL's `<t seconds>` in the prompt, `_calculate_timestamps`)."""
        fps = DEFAULT_FPS if video_fps is None else video_fps
        idx = [int(i) for i in indices]
        tps = self.temporal_patch_size
        if len(idx) % tps:
            idx.extend(idx[-1] for _ in range(tps - len(idx) % tps))
        seconds = [i / fps for i in idx]
        return [(seconds[i] + seconds[i + tps - 1]) / 2 for i in range(0, len(seconds), tps)]

    def second_per_grid(self, sampled: int, total: int, video_fps: float | None) -> float | None:
        """Seconds one temporal patch spans when `sampled` of a video's `total` frames are used (Qwen2.5-VL's
        `second_per_grid_ts`: temporal_patch_size / `VideoMetadata.sampled_fps`); None for "qwen3", whose
        prompt carries timestamps instead. Qwen2-VL's LLM does not read it."""
        if self.kind != "qwen2":
            return None
        sampled_fps = DEFAULT_FPS if video_fps is None else sampled / total * video_fps
        return self.temporal_patch_size / sampled_fps


def _sample_qwen2(cfg: VideoPreprocessConfig, total: int, video_fps: float | None) -> np.ndarray:
    tps = cfg.temporal_patch_size
    if cfg.num_frames is not None:
        n = round(cfg.num_frames / tps) * tps
    elif cfg.fps is not None:
        if video_fps is None:
            raise InvalidArgumentError(
                "sampling at a frame rate needs the video's fps: pass fps= with frames given as an array"
            )
        max_frames = math.floor(min(cfg.max_frames, total) / tps) * tps
        n = total / video_fps * cfg.fps
        n = min(max(n, cfg.min_frames), max_frames, total)
        n = math.floor(n / tps) * tps
    else:
        return np.arange(total)
    if n > total:
        raise InvalidVideoError(f"video has {total} frames, fewer than the {n} the processor samples")
    if n <= 0:
        raise InvalidVideoError(f"video has {total} frame(s), too few to sample in groups of {tps}")
    # torch.arange(0, total, total / n).int(): its length ceil(total / step); values start + i * step computed in
    # double, stored as float32, then truncated
    step = total / n
    count = math.ceil(total / step)
    return (np.arange(count, dtype=np.float64) * step).astype(np.float32).astype(np.int64)


def _sample_qwen3(cfg: VideoPreprocessConfig, total: int, video_fps: float | None) -> np.ndarray:
    n = cfg.num_frames
    if n is None and cfg.fps is not None:
        fps = DEFAULT_FPS if video_fps is None else video_fps
        n = int(total / fps * cfg.fps)
        n = min(max(n, cfg.min_frames), cfg.max_frames, total)
    if n is None:
        n = min(max(total, cfg.min_frames), cfg.max_frames)
    return np.linspace(0, total - 1, n).round().astype(int)


def qwen3_smart_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen3-VL video `smart_resize` (the same operations in the same order)."""
    if num_frames < temporal_factor:
        raise InvalidVideoError(
            f"video has {num_frames} frame(s) after sampling; this model needs at least {temporal_factor}"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise InvalidVideoError(f"aspect ratio {ratio:.1f}:1 of a {width}x{height} video exceeds the limit 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class PreparedVideo:
    """One video sampled and resized: what `patchify_video` takes (and the ingress ships to a replica)."""

    frames: np.ndarray  # uint8 [n, h, w, 3], n the sampled frames (not yet padded to the temporal patch)
    indices: np.ndarray  # the sampled frames' indices in the video
    fps: float | None  # the video's frame rate (None: unknown)
    timestamps: list[float] | None  # seconds per temporal patch (Qwen3-VL), else None
    second_per_grid_ts: float | None = None  # seconds one temporal patch spans (Qwen2/2.5-VL), else None


def check_frames(frames: Any, limits: VideoLimits = DEFAULT_VIDEO_LIMITS) -> np.ndarray:
    """A video given as frames: uint8 [frames, H, W, 3], within the limits; InvalidVideoError otherwise."""
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        got = frames.dtype if isinstance(frames, np.ndarray) else type(frames).__name__
        raise InvalidVideoError(f"video arrays must be uint8 [frames, height, width, 3], got {got}")
    if frames.ndim != 4 or frames.shape[3] != 3:
        raise InvalidVideoError(f"video arrays must be uint8 [frames, height, width, 3], got shape {frames.shape}")
    n, h, w, _ = frames.shape
    if n == 0 or h == 0 or w == 0:
        raise InvalidVideoError(f"video has zero size ({n} frames of {w}x{h})")
    if h * w > limits.max_frame_pixels:
        raise VideoTooLargeError(
            f"video frames are {w}x{h} = {w * h} pixels, over the limit max_frame_pixels={limits.max_frame_pixels}"
        )
    if n > limits.max_frames:
        raise VideoTooLargeError(f"video has {n} frames, over the limit max_frames={limits.max_frames}")
    return frames


def prepare_frames(frames: np.ndarray, video_fps: float | None, cfg: VideoPreprocessConfig) -> PreparedVideo:
    """All of a video's frames (uint8 [N, H, W, 3]) -> its sampled frames resized, as the video processor."""
    check_frames(frames, cfg.limits)
    indices = cfg.sample_indices(frames.shape[0], video_fps)
    return prepare_sampled(frames[indices], indices, video_fps, cfg, total=frames.shape[0])


def prepare_sampled(
    sampled: np.ndarray, indices: np.ndarray, video_fps: float | None, cfg: VideoPreprocessConfig, total: int
) -> PreparedVideo:
    """Frames already sampled (`sampled` = all frames[indices], out of `total`) -> resized, with the timestamps
    (Qwen3-VL) or the seconds per temporal patch (Qwen2/2.5-VL)."""
    n, h, w, _ = sampled.shape
    height, width = cfg.target_size(n, h, w)
    resized = resize_frames(sampled, height, width)
    stamps = cfg.timestamps(indices, video_fps) if cfg.kind == "qwen3" else None
    per_grid = cfg.second_per_grid(len(indices), total, video_fps)
    return PreparedVideo(np.ascontiguousarray(resized), np.asarray(indices), video_fps, stamps, per_grid)
