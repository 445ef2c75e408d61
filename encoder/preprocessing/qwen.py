"""Image preprocessing for Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers, equal to transformers' PIL processor:
the settings (`PreprocessConfig`, also read from a Hugging Face `preprocessor_config.json`) and the resize rule.

The pipeline is split so the service can ship compact data between processes:

    load_image (`encoder.preprocessing.images`: bytes / PIL / array -> RGB PIL)
    ->  cfg.resize = resize_image (-> uint8 HWC at the smart_resize size)
    ->  patchify (`encoder.patchify`: uint8 torch tensor on any device -> float32 patches in the Hugging Face order)

This module and `images` are Pillow and numpy only (no torch, so the ingress never imports it); `patchify` and
`preprocess` are `encoder.patchify`'s. `preprocess` runs all three and returns a `PatchBatch` whose
`pixel_values` / `grid_thw` match `Qwen2VLImageProcessorPil` output. Details that matter for exactness (all
mirrored from transformers 5.x):
  * Resize: PIL bicubic on the uint8 RGB image, `reducing_gap=None`; sizes by `smart_resize`'s arithmetic.
  * Rescale in float64 then cast to float32; normalise in float32. `patchify` uses a 256-entry lookup
    table per channel built that way, so results are bit-identical on CPU and need no float64 on device.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from PIL import Image
from pydantic import Field, ValidationError, model_validator

from encoder.errors import ConfigError, InvalidImageError, validation_reason
from encoder.preprocessing.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ProcessorConfig, reject_unsupported_steps
from encoder.preprocessing.image_guard import DEFAULT_LIMITS, ImageLimits
from encoder.preprocessing.images import DEFAULT_FORMATS, DEFAULT_MAX_IMAGE_PIXELS


class PreprocessConfig(ProcessorConfig):
    """Preprocessing settings; defaults are those of Qwen2-VL / Qwen2.5-VL checkpoints."""

    kind: Literal["qwen"] = Field("qwen", description="Tells this config from the ViT one in serialised form.")
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
        DEFAULT_MAX_IMAGE_PIXELS,
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

    @model_validator(mode="after")
    def _min_le_max(self) -> PreprocessConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        return self

    def resize(self, img: Image.Image) -> np.ndarray:
        """`resize_image`: the smart_resize size, PIL bicubic."""
        return resize_image(img, self)

    def num_patches(self, height: int, width: int) -> int:
        """`num_patches` of this module: patches of the smart_resize size."""
        return num_patches(height, width, self)

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


def _reject_unsupported(d: dict[str, Any]) -> None:
    reject_unsupported_steps(d)
    if d.get("resample") not in (None, int(Image.Resampling.BICUBIC)):
        raise ConfigError(f"unsupported resample {d['resample']} (only 3 = bicubic)")


DEFAULT_CONFIG = PreprocessConfig()


# ----------------------------------------------------------------------------------------- resizing


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    max_aspect_ratio: float = 200.0,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels], aspect kept.

    Same arithmetic as transformers' smart_resize (Python's banker's `round`, same operation order), so
    the sizes agree exactly; raises InvalidImageError for empty sizes or extreme aspect ratios.
    """
    if height <= 0 or width <= 0:
        raise InvalidImageError(f"image has zero size ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > max_aspect_ratio:
        raise InvalidImageError(
            f"aspect ratio {ratio:.1f}:1 of a {width}x{height} image exceeds the limit {max_aspect_ratio:g}:1"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _target_size(height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels, cfg.max_aspect_ratio)


def resize_image(img: Image.Image, cfg: PreprocessConfig = DEFAULT_CONFIG) -> np.ndarray:
    """Resize an RGB PIL image (from `load_image`) to its smart_resize size: uint8 array [H, W, 3]."""
    if not isinstance(img, Image.Image) or img.mode != "RGB":
        raise InvalidImageError("resize_image expects an RGB PIL image; call load_image first")
    h, w = _target_size(img.height, img.width, cfg)
    if (h, w) == (img.height, img.width):
        return np.array(img, dtype=np.uint8)  # PIL's resize to the same size is a copy
    # transformers resizes the uint8 RGB image with PIL bicubic and no reducing_gap.
    resized = img.resize((w, h), resample=Image.Resampling.BICUBIC, reducing_gap=None)
    return np.array(resized, dtype=np.uint8)


def num_patches(height: int, width: int, cfg: PreprocessConfig = DEFAULT_CONFIG) -> int:
    """Patches (grid t*h*w) an image of this original size yields; no decoding needed."""
    h, w = _target_size(height, width, cfg)
    return (h // cfg.patch_size) * (w // cfg.patch_size)
