"""Vision tower configs, one pydantic model per family, and the named presets.

Field names follow the Hugging Face `vision_config` of each family so a checkpoint's
`config.json` maps onto them directly (`from_hf_dict`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import ConfigError


class _QwenVisionBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: int = Field(32, gt=0, description="Number of transformer blocks.")
    num_heads: int = Field(16, gt=0, description="Attention heads per block.")
    in_channels: int = Field(3, gt=0, description="Image channels (RGB).")
    patch_size: int = Field(14, gt=0, description="Spatial patch side in pixels.")
    temporal_patch_size: int = Field(2, gt=0, description="Frames per patch; a still image is repeated.")
    spatial_merge_size: int = Field(
        2, gt=0, description="The merger concatenates m x m neighbouring patches into one output token."
    )
    rope_theta: float = Field(10000.0, gt=0, description="Base of the 2D rotary frequencies.")

    @property
    def width(self) -> int:
        """Hidden width of the blocks."""
        raise NotImplementedError

    @property
    def out_dim(self) -> int:
        """Width of the merger's output tokens (the embedding size)."""
        raise NotImplementedError

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened input patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @model_validator(mode="after")
    def _check_heads(self):
        if self.width % self.num_heads or (self.width // self.num_heads) % 4:
            raise ValueError(
                f"width {self.width} must split into {self.num_heads} heads whose size is a multiple of 4 "
                "(2D rotary uses a quarter of the head for each axis)"
            )
        return self


class Qwen2VLVisionConfig(_QwenVisionBase):
    """Qwen2-VL vision tower: LayerNorm blocks with QuickGELU MLP, full attention everywhere."""

    family: Literal["qwen2_vl"] = "qwen2_vl"
    embed_dim: int = Field(1280, gt=0, description="Hidden width of the blocks.")
    hidden_size: int = Field(1536, gt=0, description="Merger output width (the language model's width).")
    mlp_ratio: float = Field(4.0, gt=0, description="MLP hidden width = embed_dim * mlp_ratio.")
    hidden_act: Literal["quick_gelu"] = Field("quick_gelu", description="MLP activation.")

    @property
    def width(self) -> int:
        return self.embed_dim

    @property
    def out_dim(self) -> int:
        return self.hidden_size

    @property
    def mlp_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)


class Qwen25VLVisionConfig(_QwenVisionBase):
    """Qwen2.5-VL vision tower: RMSNorm blocks with SwiGLU MLP, window attention except in
    `fullatt_block_indexes`."""

    family: Literal["qwen2_5_vl"] = "qwen2_5_vl"
    hidden_size: int = Field(1280, gt=0, description="Hidden width of the blocks.")
    intermediate_size: int = Field(3420, gt=0, description="SwiGLU hidden width.")
    out_hidden_size: int = Field(3584, gt=0, description="Merger output width (the language model's width).")
    hidden_act: Literal["silu"] = Field("silu", description="Gate activation of the SwiGLU MLP.")
    window_size: int = Field(112, gt=0, description="Attention window side in pixels (before merging).")
    fullatt_block_indexes: tuple[int, ...] = Field(
        (7, 15, 23, 31), description="Blocks that attend over the whole image; the others attend in windows."
    )

    @property
    def width(self) -> int:
        return self.hidden_size

    @property
    def out_dim(self) -> int:
        return self.out_hidden_size

    @property
    def mlp_dim(self) -> int:
        return self.intermediate_size

    @property
    def window_units(self) -> int:
        """Window side in merge units (HF: window_size // spatial_merge_size // patch_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @model_validator(mode="after")
    def _check_windows(self):
        if self.window_units < 1:
            raise ValueError(f"window_size {self.window_size} is smaller than one merge unit")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"fullatt_block_indexes {bad} outside 0..{self.depth - 1}")
        return self


VisionConfig = Qwen2VLVisionConfig | Qwen25VLVisionConfig

PRESETS: dict[str, VisionConfig] = {
    # embedded default: random weights, runs in milliseconds on a CPU
    "tiny": Qwen25VLVisionConfig(
        depth=4, num_heads=4, hidden_size=64, intermediate_size=96, out_hidden_size=128,
        fullatt_block_indexes=(1, 3),
    ),
    "tiny-qwen2-vl": Qwen2VLVisionConfig(depth=3, num_heads=4, embed_dim=64, hidden_size=128, mlp_ratio=2.0),
    "qwen2-vl-2b": Qwen2VLVisionConfig(),
    "qwen2-vl-7b": Qwen2VLVisionConfig(hidden_size=3584),
    "qwen2.5-vl-3b": Qwen25VLVisionConfig(out_hidden_size=2048),
    "qwen2.5-vl-7b": Qwen25VLVisionConfig(),
}  # fmt: skip


_HF_ALIASES = {"in_chans": "in_channels", "spatial_patch_size": "patch_size"}


def from_hf_dict(vision: dict, model_type: str | None = None) -> VisionConfig:
    """Config from a Hugging Face `vision_config` dict (or a vision-only `config.json`).

    `model_type` is the top-level model type when the dict came from a full VLM config.
    """
    kinds = {str(vision.get("model_type") or ""), str(model_type or "")}
    if kinds & {"qwen2_5_vl", "qwen2_5_vl_vision"}:
        cls = Qwen25VLVisionConfig
    elif kinds & {"qwen2_vl", "qwen2_vl_vision"}:
        cls = Qwen2VLVisionConfig
    else:
        raise ConfigError(
            f"unknown model_type {sorted(k for k in kinds if k) or 'missing'}; supported: "
            "qwen2_vl, qwen2_5_vl (full VLM or vision tower config.json)"
        )
    fields = {_HF_ALIASES.get(k, k): v for k, v in vision.items()}
    theta = (fields.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        fields["rope_theta"] = theta
    known = {k: v for k, v in fields.items() if k in cls.model_fields and k != "family"}
    try:
        return cls(**known)
    except ValueError as exc:
        raise ConfigError(f"invalid vision config: {exc}") from exc


def preset(name: str) -> VisionConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None
