"""Image preprocessing for CLIP, SigLIP, DINOv2 and DINOv3 towers, equal to transformers' PIL image processors.

DINOv3's processor has no PIL form: transformers resizes the rescaled float image (torch's antialiased
bilinear); here DINOv3 images get PIL's bilinear resize of the 8-bit image like the others, about one 8-bit
level away where a resize happens (`tests/unit/encoder/models/test_dinov3.py`).

Pipeline (the same split as `encoder.preprocessing.qwen`, so the service ships compact uint8 pixels):

    load_image (shared: decoding, size limits, EXIF, RGB rule)  ->  resize_crop (-> uint8 [S, S, 3])
    ->  patchify (uint8 on any device -> float32 patches, row-major, columns (C, P, P))

`resize_crop` reproduces `CLIPImageProcessorPil` / `SiglipImageProcessorPil` / `BitImageProcessorPil` (DINOv2):
  * resize the uint8 RGB image with PIL (bicubic by default, `reducing_gap=None`) either so its
    shortest edge equals `shortest_edge` (the long edge is `int(shortest_edge * long / short)`, as
    transformers computes it) or to exactly `height` x `width`;
  * center crop to `crop_height` x `crop_width` when configured (CLIP), zero-padding an image smaller
    than the crop exactly as transformers does;
  * keep the top-left whole patches: a Conv2d patch embedding with stride P ignores the pixels past
    the last whole patch (SigLIP at 384 px with P = 14 uses 378 x 378), so they are dropped here and
    every array the service ships has sides that are multiples of P.
Rescale (x / 255 in float64, cast to float32) and normalise ((x - mean) / std in float32) happen in
`encoder.patchify.patchify` through its per-channel lookup table: bit-identical to transformers.
`VitPreprocessConfig` has `merge_size = temporal_patch_size = 1`, so that patchify (and every caller
of it, such as the service's on-device patchify) produces the ViT patch layout unchanged; its `resize` and
`num_patches` are those of every `encoder.preprocessing.config.ProcessorConfig`, so code that serves any model
calls them without asking the family.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from PIL import Image
from pydantic import Field, ValidationError, field_validator, model_validator

from encoder.config import ClipVisionConfig, Dinov2VisionConfig, Dinov3VisionConfig, VitVisionConfig
from encoder.errors import ConfigError, InvalidImageError, validation_reason
from encoder.preprocessing.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ProcessorConfig, reject_unsupported_steps
from encoder.preprocessing.image_guard import DEFAULT_LIMITS, ImageLimits
from encoder.preprocessing.images import DEFAULT_FORMATS, DEFAULT_MAX_IMAGE_PIXELS

SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the published DINOv2 preprocessor_config.json
IMAGENET_STD = (0.229, 0.224, 0.225)
_PIL_FILTERS = {int(f) for f in Image.Resampling}


class VitPreprocessConfig(ProcessorConfig):
    """Preprocessing of a fixed-resolution tower (CLIP / SigLIP); `for_model` gives the defaults."""

    kind: Literal["vit"] = Field("vit", description="Tells this config from the Qwen one in serialised form.")
    patch_size: int = Field(14, gt=0, description="Patch side of the tower, in pixels.")
    shortest_edge: int | None = Field(
        None, gt=0, description="Resize so the shorter side has this length (aspect kept); else height x width."
    )
    height: int | None = Field(None, gt=0, description="Resize height when shortest_edge is not set.")
    width: int | None = Field(None, gt=0, description="Resize width when shortest_edge is not set.")
    crop_height: int | None = Field(None, gt=0, description="Center-crop height after the resize (None: no crop).")
    crop_width: int | None = Field(None, gt=0, description="Center-crop width after the resize.")
    resample: int = Field(int(Image.Resampling.BICUBIC), description="PIL resampling filter (3 = bicubic).")
    image_mean: tuple[float, float, float] = Field(OPENAI_CLIP_MEAN, description="Per-channel RGB mean.")
    image_std: tuple[float, float, float] = Field(OPENAI_CLIP_STD, description="Per-channel RGB std (> 0).")
    max_aspect_ratio: float = Field(
        200.0,
        ge=1.0,
        description="Longer/shorter side ratio above which images are rejected when resizing by the shortest "
        "edge (the intermediate image grows with the ratio; transformers has no limit).",
    )
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

    @model_validator(mode="after")
    def _one_size_rule(self) -> VitPreprocessConfig:
        if self.shortest_edge is None and (self.height is None or self.width is None):
            raise ValueError("set shortest_edge, or both height and width")
        if self.shortest_edge is not None and (self.height is not None or self.width is not None):
            raise ValueError("set shortest_edge or height/width, not both")
        if (self.crop_height is None) != (self.crop_width is None):
            raise ValueError("set both crop_height and crop_width, or neither")
        if self.shortest_edge is not None and self.crop_height is None:
            raise ValueError("a shortest-edge resize without a center crop gives images of varying size")
        out_h, out_w = self.output_size
        if out_h == 0 or out_w == 0:
            raise ValueError(f"the processed image is smaller than one {self.patch_size}-pixel patch")
        return self

    # -- the attributes `encoder.patchify.patchify` and the service read ----------------------------
    @property
    def merge_size(self) -> int:
        return 1

    @property
    def temporal_patch_size(self) -> int:
        return 1

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of `resize_crop`'s arrays: the crop (or resize) size cut to whole patches."""
        h, w = (self.crop_height, self.crop_width) if self.crop_height is not None else (self.height, self.width)
        if h is None:  # shortest edge without crop: rejected by the validator
            return 0, 0
        p = self.patch_size
        return h // p * p, w // p * p

    def num_patches(self, height: int | None = None, width: int | None = None) -> int:
        """Patches of every processed image, whatever the original size (`height`, `width`: unused)."""
        h, w = self.output_size
        return (h // self.patch_size) * (w // self.patch_size)

    def resize(self, img: Image.Image) -> np.ndarray:
        """`resize_crop`: resize, center crop, whole patches."""
        return resize_crop(img, self)

    @property
    def min_pixels(self) -> int:
        """Pixels of every processed image (the Qwen config's bounds; here both are the one size)."""
        h, w = self.output_size
        return h * w

    @property
    def max_pixels(self) -> int:
        return self.min_pixels

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def for_model(cls, cfg: VitVisionConfig, **overrides: Any) -> VitPreprocessConfig:
        """The processor a checkpoint of this config ships: CLIP resizes the shortest edge to the
        image size and center-crops; SigLIP resizes to a square. Means/stds of the family."""
        s = cfg.image_size
        if isinstance(cfg, ClipVisionConfig):
            kwargs = dict(shortest_edge=s, crop_height=s, crop_width=s)
        elif isinstance(cfg, Dinov2VisionConfig):  # published: shortest edge 256, crop 224, ImageNet mean/std
            kwargs = dict(shortest_edge=s * 256 // 224, crop_height=s, crop_width=s, image_mean=IMAGENET_MEAN,
                          image_std=IMAGENET_STD)  # fmt: skip
        elif isinstance(cfg, Dinov3VisionConfig):  # DINOv3ViTImageProcessor: square bilinear resize, ImageNet
            kwargs = dict(height=s, width=s, resample=int(Image.Resampling.BILINEAR), image_mean=IMAGENET_MEAN,
                          image_std=IMAGENET_STD)  # fmt: skip
        else:
            kwargs = dict(height=s, width=s, image_mean=SIGLIP_MEAN, image_std=SIGLIP_STD)
        try:
            return cls(patch_size=cfg.patch_size, **kwargs, **overrides)
        except ValidationError as e:
            raise ConfigError(f"invalid preprocessing for this model: {validation_reason(e)}") from e

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], cfg: VitVisionConfig) -> VitPreprocessConfig:
        """From a `preprocessor_config.json` dict; keys it lacks take the family's processor defaults.

        Raises ConfigError for switches we do not implement (no resize, no rescale, no normalise,
        another rescale factor, padding, a shortest+longest edge rule) and when the processed image
        does not have the model's size (transformers' model would refuse it too).
        """
        # DINOv2's BitImageProcessor defaults as CLIP's: shortest edge, center crop, CLIP mean/std
        clip = isinstance(cfg, ClipVisionConfig | Dinov2VisionConfig)
        reject_unsupported_steps(d)
        if d.get("do_pad"):
            raise ConfigError("preprocessor config sets do_pad=true, which this encoder does not support")
        square = bool(d.get("default_to_square", False))  # both processors: an int size is the shortest edge
        size = _size_dict(d.get("size"), square, "size")
        kwargs: dict[str, Any] = {"patch_size": cfg.patch_size}
        if size is None:  # no size key: the model's own image size, by the family's rule
            s = cfg.image_size
            size = {"shortest_edge": s} if clip else {"height": s, "width": s}
        if set(size) == {"shortest_edge"}:
            kwargs["shortest_edge"] = size["shortest_edge"]
        elif set(size) == {"height", "width"}:
            kwargs["height"], kwargs["width"] = size["height"], size["width"]
        else:
            raise ConfigError(f"unsupported preprocessor size {size} (expected shortest_edge, or height and width)")
        if d.get("do_center_crop", clip):
            crop_size = d.get("crop_size")  # absent or null: the model's image size, as for size
            crop = _size_dict(cfg.image_size if crop_size is None else crop_size, True, "crop_size")
            if set(crop) != {"height", "width"}:
                raise ConfigError(f"unsupported crop_size {crop} (expected height and width)")
            kwargs["crop_height"], kwargs["crop_width"] = crop["height"], crop["width"]
        for key in ("image_mean", "image_std"):
            value = d.get(key)
            if value is not None:
                # a scalar is every channel's; the model validates the values (ConfigError below)
                kwargs[key] = tuple(value) if isinstance(value, list | tuple) else (value,) * 3
        if "resample" in d and d["resample"] is not None:
            kwargs["resample"] = d["resample"]
        elif isinstance(cfg, Dinov3VisionConfig):
            kwargs["resample"] = int(Image.Resampling.BILINEAR)
        if isinstance(cfg, Dinov2VisionConfig):  # BitImageProcessor's class defaults
            mean, std = OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        else:
            defaults = cls.for_model(cfg)
            mean, std = defaults.image_mean, defaults.image_std
        kwargs.setdefault("image_mean", mean)
        kwargs.setdefault("image_std", std)
        try:
            pp = cls(**kwargs)
        except ValidationError as e:
            raise ConfigError(f"invalid preprocessor config: {validation_reason(e)}") from e
        check_matches_model(pp, cfg)
        return pp


def _size_dict(value: Any, square: bool, name: str) -> dict[str, int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, list | tuple) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    raise ConfigError(f"preprocessor config {name!r} must be an int, [height, width] or a dict, got {value!r}")


def check_matches_model(pp: VitPreprocessConfig, cfg: VitVisionConfig) -> None:
    """The processed image must give exactly the tower's patch grid."""
    if pp.patch_size != cfg.patch_size:
        raise ConfigError(f"preprocessing patch size {pp.patch_size} differs from the model's {cfg.patch_size}")
    grid = tuple(s // pp.patch_size for s in pp.output_size)
    if grid != (cfg.grid, cfg.grid):
        raise ConfigError(
            f"preprocessing gives {pp.output_size[0]}x{pp.output_size[1]}-pixel images ({grid[0]}x{grid[1]} "
            f"patches); the model takes {cfg.image_size}x{cfg.image_size} ({cfg.grid}x{cfg.grid} patches)"
        )


# ----------------------------------------------------------------------------------------- resizing


def resize_size(height: int, width: int, cfg: VitPreprocessConfig) -> tuple[int, int]:
    """(height, width) of the resize step, with transformers' arithmetic."""
    if height <= 0 or width <= 0:
        raise InvalidImageError(f"image has zero size ({width}x{height})")
    if cfg.shortest_edge is None:
        return cfg.height, cfg.width
    short, long = (width, height) if width <= height else (height, width)
    if long / short > cfg.max_aspect_ratio:
        raise InvalidImageError(
            f"aspect ratio {long / short:.1f}:1 of a {width}x{height} image exceeds the limit "
            f"{cfg.max_aspect_ratio:g}:1"
        )
    new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(arr: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """Center crop [H, W, C]; an image smaller than the crop is zero-padded first (transformers' rule)."""
    h, w = arr.shape[:2]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:
        return arr[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((new_h, new_w, arr.shape[2]), dtype=arr.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[top_pad : top_pad + h, left_pad : left_pad + w] = arr
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]


def resize_crop(img: Image.Image, cfg: VitPreprocessConfig) -> np.ndarray:
    """RGB PIL image (from `load_image`) -> uint8 [H, W, 3] at `cfg.output_size`."""
    if not isinstance(img, Image.Image) or img.mode != "RGB":
        raise InvalidImageError("resize_crop expects an RGB PIL image; call load_image first")
    h, w = resize_size(img.height, img.width, cfg)
    arr = np.array(img.resize((w, h), resample=cfg.resample, reducing_gap=None), dtype=np.uint8)
    if cfg.crop_height is not None:
        arr = center_crop(arr, cfg.crop_height, cfg.crop_width)
    out_h, out_w = cfg.output_size
    return np.ascontiguousarray(arr[:out_h, :out_w])
