"""`PreprocessConfig`: the preprocessing settings of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL tower, with the
validators the CLIP / SigLIP config (`encoder.preprocessing.vit`) shares, and the reading of a Hugging Face
`preprocessor_config.json`. The pipeline that uses them is `encoder.preprocessing.qwen`.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from encoder.errors import ConfigError, validation_reason
from encoder.preprocessing.image_guard import DEFAULT_LIMITS, ImageLimits

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"})


def std_positive(v: tuple[float, ...]) -> tuple[float, ...]:
    """Validator shared by the preprocessing configs: every image_std entry > 0."""
    if any(s <= 0 for s in v):
        raise ValueError(f"image_std must be > 0, got {v}")
    return v


def known_formats(v) -> frozenset[str]:
    """Validator shared by the preprocessing configs: a non-empty set of Pillow format names, upper-cased."""
    Image.init()
    v = frozenset(f.upper() for f in v)
    unknown = sorted(v - set(Image.OPEN))
    if not v or unknown:
        raise ValueError(f"allowed_formats must be non-empty Pillow format names; unknown: {unknown}")
    return v


class PreprocessConfig(BaseModel):
    """Preprocessing settings; defaults are those of Qwen2-VL / Qwen2.5-VL checkpoints."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_pixels: int = Field(56 * 56, gt=0, description="Lower bound on resized height*width (HF shortest_edge).")
    max_pixels: int = Field(28 * 28 * 1280, gt=0, description="Upper bound on resized height*width (HF longest_edge).")
    patch_size: int = Field(14, gt=0, description="Spatial patch side of the vision tower, in pixels.")
    temporal_patch_size: int = Field(2, gt=0, description="Frames per patch; a still image is repeated.")
    merge_size: int = Field(2, gt=0, description="Patches merged per side; resized sides are multiples of P*m.")
    image_mean: tuple[float, float, float] = Field(OPENAI_CLIP_MEAN, description="Per-channel RGB mean.")
    image_std: tuple[float, float, float] = Field(OPENAI_CLIP_STD, description="Per-channel RGB std (> 0).")
    max_aspect_ratio: float = Field(
        200.0, ge=1.0, description="Longer/shorter side ratio above which images are rejected (HF: 200)."
    )
    max_image_pixels: int = Field(
        100_000_000,
        gt=0,
        description="Limit on width*height of the DECODED input (before resize), read from the file header "
        "before decoding, so decompression bombs are refused without allocating. Pillow's own bomb check "
        "(error above 2*PIL.Image.MAX_IMAGE_PIXELS, ~179 MP) applies on top of this.",
    )
    allowed_formats: frozenset[str] = Field(
        DEFAULT_FORMATS, description="Pillow format names accepted for encoded bytes (upper case)."
    )
    image_limits: ImageLimits = Field(
        DEFAULT_LIMITS,
        description="Structural limits on encoded bytes (JPEG scans, chunks, frames), checked "
        "before Pillow parses them (`encoder.preprocessing.image_guard`).",
    )

    @field_validator("image_std")
    @classmethod
    def _std_positive(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        return std_positive(v)

    @field_validator("allowed_formats")
    @classmethod
    def _known_formats(cls, v: frozenset[str]) -> frozenset[str]:
        return known_formats(v)

    @model_validator(mode="after")
    def _min_le_max(self) -> PreprocessConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        return self

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (patch_size * merge_size)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> PreprocessConfig:
        """Build from a Hugging Face `preprocessor_config.json` dict; unknown keys are ignored.

        Top-level `min_pixels`/`max_pixels` win over `size` (as in transformers). Known switches we cannot
        honour (no resize/rescale/normalise, other rescale factor or resample) raise ConfigError rather
        than silently producing different pixels. Invalid values also raise ConfigError.
        """
        _reject_unsupported(d)
        size = d.get("size") or {}
        if not isinstance(size, dict):
            raise ConfigError(f"preprocessor config 'size' must be a dict, got {size!r}")
        picks = {
            "min_pixels": _first(d.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels")),
            "max_pixels": _first(d.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels")),
        }
        for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
            picks[key] = d.get(key)
        for key in ("image_mean", "image_std"):  # transformers takes one number for every channel
            if isinstance(picks[key], int | float) and not isinstance(picks[key], bool):
                picks[key] = (picks[key],) * 3
        kwargs = {k: v for k, v in picks.items() if v is not None} | overrides
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise ConfigError(f"invalid preprocessor config: {validation_reason(e)}") from e


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def reject_unsupported_steps(d: dict[str, Any]) -> None:
    """The processing steps every family's processor must keep (Qwen's and CLIP/SigLIP's): no step switched off,
    the rescale by 1/255."""
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if d.get(flag) is False:
            raise ConfigError(f"preprocessor config sets {flag}=false, which this encoder does not support")
    factor = d.get("rescale_factor")
    if factor is not None and (not isinstance(factor, int | float) or not math.isclose(factor, 1 / 255)):
        raise ConfigError(f"unsupported rescale_factor {factor!r} (only 1/255)")


def _reject_unsupported(d: dict[str, Any]) -> None:
    reject_unsupported_steps(d)
    if d.get("resample") not in (None, int(Image.Resampling.BICUBIC)):
        raise ConfigError(f"unsupported resample {d['resample']} (only 3 = bicubic)")
