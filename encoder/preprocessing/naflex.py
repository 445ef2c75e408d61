"""Image preprocessing for SigLIP2 NaFlex towers, equal to transformers' `Siglip2ImageProcessorPil`.

Pipeline (the same split as `encoder.preprocessing.qwen` and `vit`):

    load_image (shared)  ->  resize_naflex (-> uint8 [H, W, 3], sides multiples of P)
    ->  patchify (float32 patches, row-major, columns (P, P, C): `channels_last`)

The size is transformers' `get_image_size_for_max_num_patches`: a binary search for the largest scale at
which the image, each side rounded up to whole patches (at least one), has at most `max_num_patches`
patches; the aspect ratio is kept up to that rounding. The resize is PIL's (bilinear by default,
`reducing_gap=None`) on the uint8 RGB image. Rescale and normalise are `encoder.patchify.patchify`'s lookup
table, bit-identical to transformers. transformers then pads every image to `max_num_patches` rows and masks
them; here each image keeps its own rows and the tower packs them (no padding).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from PIL import Image
from pydantic import Field, ValidationError, field_validator

from encoder.config import Siglip2VisionConfig
from encoder.errors import ConfigError, InvalidImageError, validation_reason
from encoder.preprocessing.config import ProcessorConfig, reject_unsupported_steps
from encoder.preprocessing.image_guard import DEFAULT_LIMITS, ImageLimits
from encoder.preprocessing.images import DEFAULT_FORMATS, DEFAULT_MAX_IMAGE_PIXELS

NAFLEX_MEAN = (0.5, 0.5, 0.5)
NAFLEX_STD = (0.5, 0.5, 0.5)
_PIL_FILTERS = {int(f) for f in Image.Resampling}


class NaflexPreprocessConfig(ProcessorConfig):
    """Preprocessing of a SigLIP2 NaFlex tower; defaults are transformers' `Siglip2ImageProcessor`'s."""

    kind: Literal["naflex"] = Field("naflex", description="Tells this config from the others in serialised form.")
    patch_size: int = Field(16, gt=0, description="Patch side of the tower, in pixels.")
    max_num_patches: int = Field(256, gt=0, description="Upper bound on an image's patches after the resize.")
    resample: int = Field(int(Image.Resampling.BILINEAR), description="PIL resampling filter (2 = bilinear).")
    image_mean: tuple[float, float, float] = Field(NAFLEX_MEAN, description="Per-channel RGB mean.")
    image_std: tuple[float, float, float] = Field(NAFLEX_STD, description="Per-channel RGB std (> 0).")
    max_image_pixels: int = Field(
        DEFAULT_MAX_IMAGE_PIXELS, gt=0, description="Limit on width*height of the decoded input (see PreprocessConfig)."
    )
    allowed_formats: frozenset[str] = Field(DEFAULT_FORMATS, description="Pillow format names accepted for bytes.")
    image_limits: ImageLimits = Field(
        DEFAULT_LIMITS, description="Structural limits on encoded bytes (see PreprocessConfig)."
    )

    @field_validator("resample")
    @classmethod
    def _known_filter(cls, v):
        if v not in _PIL_FILTERS:
            raise ValueError(f"resample must be a PIL filter ({sorted(_PIL_FILTERS)}), got {v}")
        return v

    # -- the attributes `encoder.patchify.patchify` and the service read ----------------------------
    @property
    def merge_size(self) -> int:
        return 1

    @property
    def temporal_patch_size(self) -> int:
        return 1

    @property
    def channels_last(self) -> bool:
        """Patch columns are (P, P, C), as transformers flattens them (the tower's linear patch embedding)."""
        return True

    @property
    def min_pixels(self) -> int:
        """Pixels of the smallest processed image: one patch."""
        return self.patch_size**2

    @property
    def max_pixels(self) -> int:
        """Pixels of the largest processed image: `max_num_patches` patches."""
        return self.max_num_patches * self.patch_size**2

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the resized image, with transformers' arithmetic."""
        return naflex_size(height, width, self.patch_size, self.max_num_patches)

    def num_patches(self, height: int, width: int) -> int:
        """Patches of an image of this original size once resized."""
        h, w = self.output_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size)

    def resize(self, img: Image.Image) -> np.ndarray:
        """`resize_naflex`: the NaFlex size, PIL resample."""
        return resize_naflex(img, self)

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def for_model(cls, cfg: Siglip2VisionConfig, **overrides: Any) -> NaflexPreprocessConfig:
        """The processor a checkpoint of this config ships: as many patches as the position table has."""
        kwargs = dict(patch_size=cfg.patch_size, max_num_patches=cfg.num_patches) | overrides
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise ConfigError(f"invalid preprocessing for this model: {validation_reason(e)}") from e

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], cfg: Siglip2VisionConfig) -> NaflexPreprocessConfig:
        """From a `preprocessor_config.json` dict of a `Siglip2ImageProcessor`; keys it lacks take that
        processor's defaults (patch 16, 256 patches, bilinear, mean = std = 0.5). Raises ConfigError for
        switched-off steps, another rescale factor, or a patch size other than the model's."""
        reject_unsupported_steps(d)
        kwargs: dict[str, Any] = {}
        for key in ("patch_size", "max_num_patches", "resample"):
            if d.get(key) is not None:
                kwargs[key] = d[key]
        for key in ("image_mean", "image_std"):
            value = d.get(key)
            if value is not None:
                kwargs[key] = tuple(value) if isinstance(value, list | tuple) else (value,) * 3
        try:
            pp = cls(**kwargs)
        except ValidationError as e:
            raise ConfigError(f"invalid preprocessor config: {validation_reason(e)}") from e
        if pp.patch_size != cfg.patch_size:
            raise ConfigError(f"preprocessing patch size {pp.patch_size} differs from the model's {cfg.patch_size}")
        return pp


def naflex_size(height: int, width: int, patch_size: int, max_num_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """transformers' `get_image_size_for_max_num_patches`, step for step (the same float arithmetic)."""
    if height <= 0 or width <= 0:
        raise InvalidImageError(f"image has zero size ({width}x{height})")

    def scaled(scale: float, size: int) -> int:
        return int(max(patch_size, math.ceil(size * scale / patch_size) * patch_size))

    scale_min, scale_max = eps / 10, 100.0
    while (scale_max - scale_min) >= eps:
        scale = (scale_min + scale_max) / 2
        patches = (scaled(scale, height) / patch_size) * (scaled(scale, width) / patch_size)
        if patches <= max_num_patches:
            scale_min = scale
        else:
            scale_max = scale
    return scaled(scale_min, height), scaled(scale_min, width)


def resize_naflex(img: Image.Image, cfg: NaflexPreprocessConfig) -> np.ndarray:
    """RGB PIL image (from `load_image`) -> uint8 [H, W, 3] at the NaFlex size."""
    if not isinstance(img, Image.Image) or img.mode != "RGB":
        raise InvalidImageError("resize_naflex expects an RGB PIL image; call load_image first")
    h, w = cfg.output_size(img.height, img.width)
    return np.ascontiguousarray(np.array(img.resize((w, h), resample=cfg.resample, reducing_gap=None), dtype=np.uint8))
