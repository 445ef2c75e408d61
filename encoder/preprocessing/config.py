"""`ProcessorConfig`: what every family's preprocessing config offers the code that serves any model, and the
validators and checks the families share. The families are `encoder.preprocessing.qwen.PreprocessConfig`
(Qwen2-VL / Qwen2.5-VL / Qwen3-VL) and `encoder.preprocessing.vit.VitPreprocessConfig` (CLIP / SigLIP);
`encoder.preprocessing.families.preprocess_config_from_dump` reads either back from its dump.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, field_validator

from encoder.errors import ConfigError
from encoder.preprocessing.images import known_formats

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def std_positive(v: tuple[float, ...]) -> tuple[float, ...]:
    """Validator shared by the preprocessing configs: every image_std entry > 0."""
    if any(s <= 0 for s in v):
        raise ValueError(f"image_std must be > 0, got {v}")
    return v


class PatchSizes:
    """What a config of `patch_size`, `merge_size` and `temporal_patch_size` fields derives from them (the image
    processors' `ProcessorConfig` and the Qwen video processors' `VideoPreprocessConfig`)."""

    @property
    def factor(self) -> int:
        """Sides of the resized arrays are multiples of this (patch_size * merge_size)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x frames x patch area."""
        return 3 * self.temporal_patch_size * self.patch_size**2


class ProcessorConfig(PatchSizes, BaseModel):
    """A family's preprocessing settings and its resize rule. Each family declares its fields, among them the
    ones every caller reads: `kind` (the family, also in the dump), `patch_size`, `merge_size`,
    `temporal_patch_size`, `image_mean`, `image_std`, and the decode limits `load_image` reads
    (`max_image_pixels`, `allowed_formats`, `image_limits`). The pipeline is the same for both:

        encoder.preprocessing.images.load_image(x, cfg)  ->  cfg.resize(img) (uint8 [H, W, 3])
        ->  encoder.patchify.patchify(pixels, cfg) (torch)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("image_std", check_fields=False)
    @classmethod
    def _std_positive(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        return std_positive(v)

    @field_validator("allowed_formats", check_fields=False)
    @classmethod
    def _known_formats(cls, v: frozenset[str]) -> frozenset[str]:
        return known_formats(v)

    @property
    def channels_last(self) -> bool:
        """Patch columns (P, P, C) instead of (C, T, P, P) (`encoder.patchify.patchify`; SigLIP2 NaFlex)."""
        return False

    @abstractmethod
    def resize(self, img: Image.Image) -> np.ndarray:
        """RGB PIL image (from `load_image`) -> uint8 [H, W, 3], the sides multiples of `factor`."""
        raise NotImplementedError

    @abstractmethod
    def num_patches(self, height: int, width: int) -> int:
        """Patches an image of this original size yields once resized (no decoding needed)."""
        raise NotImplementedError


def reject_unsupported_steps(d: dict[str, Any]) -> None:
    """The processing steps every family's processor must keep (Qwen's and CLIP/SigLIP's): no step switched off,
    the rescale by 1/255."""
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if d.get(flag) is False:
            raise ConfigError(f"preprocessor config sets {flag}=false, which this encoder does not support")
    factor = d.get("rescale_factor")
    if factor is not None and (not isinstance(factor, int | float) or not math.isclose(factor, 1 / 255)):
        raise ConfigError(f"unsupported rescale_factor {factor!r} (only 1/255)")
