"""Vision tower configs, one pydantic model per family (the named presets are in `encoder.loading.presets`).

Field names follow the Hugging Face `vision_config` of each family so a checkpoint's
`config.json` maps onto them directly (`from_hf_dict`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from encoder.errors import ConfigError, reason, validation_reason

# The names `encoder.load(dtype=...)` takes (`api.DTYPES` maps them to torch dtypes) and the attention backends
# built in (`attention.registry`; a unit test keeps both lists equal to theirs): here, without torch, so a
# driver can check a service's arguments before anything starts.
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
BUILTIN_ATTENTION = ("sdpa", "triton", "torch_varlen", "flash_attn", "fa3", "fa4")


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


class Qwen3VLVisionConfig(_QwenVisionBase):
    """Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 vision tower: LayerNorm blocks with a GELU MLP, full attention
    everywhere, a learned position table bilinearly resampled to each image's grid, and DeepStack
    mergers after `deepstack_visual_indexes` (none for Qwen3.5)."""

    family: Literal["qwen3_vl"] = "qwen3_vl"
    depth: int = Field(27, gt=0, description="Number of transformer blocks.")
    patch_size: int = Field(16, gt=0, description="Spatial patch side in pixels.")
    hidden_size: int = Field(1152, gt=0, description="Hidden width of the blocks.")
    intermediate_size: int = Field(4304, gt=0, description="MLP hidden width.")
    out_hidden_size: int = Field(3584, gt=0, description="Merger output width (the language model's width).")
    hidden_act: Literal["gelu_pytorch_tanh", "gelu", "quick_gelu"] = Field(
        "gelu_pytorch_tanh", description="Block MLP activation (the mergers always use exact GELU, as in HF)."
    )
    num_position_embeddings: int = Field(
        2304, gt=0, description="Rows of the learned position table, a square grid (48 x 48 by default)."
    )
    deepstack_visual_indexes: tuple[int, ...] = Field(
        (8, 16, 24), description="Blocks whose outputs feed a DeepStack merger, in output order (empty: none)."
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
    def num_grid_per_side(self) -> int:
        """Side of the learned position grid (HF: int(num_position_embeddings ** 0.5))."""
        return int(self.num_position_embeddings**0.5)

    @model_validator(mode="after")
    def _check_tables(self):
        if self.num_grid_per_side**2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square grid")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} outside 0..{self.depth - 1}")
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {list(self.deepstack_visual_indexes)} repeat a block")
        return self


class _PlainVitBase(BaseModel):
    """What every plain-ViT `vision_config` has (CLIP, SigLIP, SigLIP2, DINOv2, DINOv3): pre-norm blocks of
    one width, no temporal patches, no patch merging.

    Field names are those of the Hugging Face `vision_config`. The properties named like the Qwen
    configs' (`width`, `depth`, `patch_dim`, `merge_unit`, ...) let shared code (buckets, runner,
    service) treat every kind alike.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(768, gt=0, description="Hidden width of the blocks.")
    intermediate_size: int = Field(3072, gt=0, description="MLP hidden width.")
    num_hidden_layers: int = Field(12, gt=0, description="Number of transformer blocks.")
    num_attention_heads: int = Field(12, gt=0, description="Attention heads per block.")
    num_channels: int = Field(3, gt=0, description="Image channels (RGB).")
    patch_size: int = Field(16, gt=0, description="Patch side in pixels.")
    layer_norm_eps: float = Field(1e-5, gt=0, description="LayerNorm epsilon.")

    @model_validator(mode="after")
    def _check_heads(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        return self

    # -- the names shared code reads -------------------------------------------------------------
    @property
    def width(self) -> int:
        return self.hidden_size

    @property
    def depth(self) -> int:
        return self.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mlp_dim(self) -> int:
        return self.intermediate_size

    @property
    def in_channels(self) -> int:
        return self.num_channels

    @property
    def temporal_patch_size(self) -> int:
        return 1

    @property
    def spatial_merge_size(self) -> int:
        return 1

    @property
    def merge_unit(self) -> int:
        return 1

    @property
    def patch_dim(self) -> int:
        """Values per flattened input patch: C * P * P (the Conv2d kernel, flattened)."""
        return self.num_channels * self.patch_size**2

    @property
    def has_class_token(self) -> bool:
        return False

    @property
    def token_dim(self) -> int:
        """Width of the per-token outputs (pooling "none" and "mean")."""
        return self.hidden_size

    @property
    def out_dim(self) -> int:
        """Width of the model's own image embedding (pooling "model")."""
        raise NotImplementedError


class _VitVisionBase(_PlainVitBase):
    """A plain ViT over one fixed-resolution image: every image is (image_size / patch_size)^2 patches."""

    image_size: int = Field(224, gt=0, description="Side of the (square) input image in pixels.")
    patch_size: int = Field(16, gt=0, description="Patch side in pixels; pixels past the last whole patch are unused.")

    @field_validator("image_size", "patch_size", mode="before")
    @classmethod
    def _square(cls, v):
        # HF configs may give [h, w]; the towers (and HF's position embeddings) assume a square
        if isinstance(v, list | tuple):
            if len(v) != 2 or v[0] != v[1]:
                raise ValueError(f"only square sizes are supported, got {list(v)}")
            return v[0]
        return v

    @model_validator(mode="after")
    def _check_image(self):
        if self.image_size < self.patch_size:
            raise ValueError(f"image_size {self.image_size} is smaller than one patch ({self.patch_size})")
        return self

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Patches (and patch tokens) per image: fixed, the unit of the bucket table."""
        return self.grid**2

    @property
    def prefix_tokens(self) -> int:
        """Tokens before each image's patches inside the blocks (a class token where there is one)."""
        return int(self.has_class_token)

    @property
    def seq_len(self) -> int:
        """Tokens per image inside the blocks: the prefix tokens, then the patches."""
        return self.prefix_tokens + self.num_patches


class ClipVisionConfig(_VitVisionBase):
    """CLIP vision tower with its projection (`CLIPVisionModelWithProjection`): class token, pre- and
    post-LayerNorm, `image_embeds` = visual_projection(post_layernorm(class token))."""

    family: Literal["clip"] = "clip"
    patch_size: int = Field(32, gt=0, description="Patch side in pixels.")
    projection_dim: int = Field(512, gt=0, description="Width of image_embeds (the visual projection).")
    hidden_act: Literal["quick_gelu", "gelu", "gelu_pytorch_tanh"] = Field("quick_gelu", description="MLP activation.")

    @property
    def has_class_token(self) -> bool:
        return True

    @property
    def out_dim(self) -> int:
        return self.projection_dim


class SiglipVisionConfig(_VitVisionBase):
    """SigLIP vision tower (`SiglipVisionModel`): no class token, post-LayerNorm on every token, and
    `pooler_output` from the multi-head attention-pooling head."""

    family: Literal["siglip"] = "siglip"
    layer_norm_eps: float = Field(1e-6, gt=0, description="LayerNorm epsilon.")
    hidden_act: Literal["gelu_pytorch_tanh", "gelu", "quick_gelu"] = Field(
        "gelu_pytorch_tanh", description="MLP activation."
    )
    vision_use_head: Literal[True] = Field(
        True, description="The attention-pooling head; towers without it (no pooler_output) are not supported."
    )

    @property
    def out_dim(self) -> int:
        return self.hidden_size


class Siglip2VisionConfig(_PlainVitBase):
    """SigLIP2 NaFlex vision tower (`Siglip2VisionModel`): SigLIP's blocks, post-LayerNorm and attention-pooling
    head over images of any patch grid (up to the processor's `max_num_patches`), the learned square position
    table resized to each image's grid. Variable resolution: images are packed, attention stays within each.
    A patch is flattened P * P * C (channels last, as the processor flattens it)."""

    family: Literal["siglip2"] = "siglip2"
    num_patches: int = Field(256, gt=0, description="Rows of the learned position table, a square grid (16 x 16).")
    layer_norm_eps: float = Field(1e-6, gt=0, description="LayerNorm epsilon.")
    hidden_act: Literal["gelu_pytorch_tanh", "gelu", "quick_gelu"] = Field(
        "gelu_pytorch_tanh", description="MLP activation."
    )
    vision_use_head: Literal[True] = Field(
        True, description="The attention-pooling head; towers without it (no pooler_output) are not supported."
    )

    @model_validator(mode="after")
    def _check_positions(self):
        if self.position_grid**2 != self.num_patches:
            raise ValueError(f"num_patches {self.num_patches} is not a square grid")
        return self

    @property
    def position_grid(self) -> int:
        """Side of the learned position table (HF: int(num_patches ** 0.5))."""
        return int(self.num_patches**0.5)

    @property
    def out_dim(self) -> int:
        """Width of pooler_output (pooling "model")."""
        return self.hidden_size


class _DinoVisionBase(_VitVisionBase):
    """What DINOv2 and DINOv3 share: a class token and register tokens before the patches, a final LayerNorm,
    `pooler_output` the normed class token."""

    num_register_tokens: int = Field(0, ge=0, description="Register tokens after the class token.")

    @property
    def has_class_token(self) -> bool:
        return True

    @property
    def prefix_tokens(self) -> int:
        """Tokens before each image's patches inside the blocks: the class token, the registers."""
        return 1 + self.num_register_tokens

    @property
    def out_dim(self) -> int:
        return self.hidden_size


class Dinov2VisionConfig(_DinoVisionBase):
    """DINOv2 / DINOv2 with registers (`Dinov2Model`, `Dinov2WithRegistersModel`): class token, register
    tokens (with registers), a learned position table bicubically resized to the input grid, layer scale
    on both branches, a final LayerNorm; `pooler_output` is the normed class token.

    `image_size` is the side of the images the tower takes (the image processor's crop, 224 in the published
    checkpoints); the position table's side is `position_image_size` (HF's `image_size`, 518 published).
    """

    family: Literal["dinov2"] = "dinov2"
    image_size: int = Field(224, gt=0, description="Side of the (square) input image in pixels (the processor's crop).")
    patch_size: int = Field(14, gt=0, description="Patch side in pixels.")
    position_image_size: int = Field(
        518, gt=0, description="HF's image_size: the position table has (position_image_size / patch_size)^2 rows."
    )
    layer_norm_eps: float = Field(1e-6, gt=0, description="LayerNorm epsilon.")
    hidden_act: Literal["gelu", "quick_gelu", "gelu_pytorch_tanh"] = Field("gelu", description="MLP activation.")
    use_swiglu_ffn: bool = Field(
        False, description="SwiGLU MLP (giant): hidden (int(intermediate_size * 2/3) + 7) // 8 * 8."
    )
    qkv_bias: bool = Field(True, description="Biases on the q/k/v projections.")
    num_register_tokens: int = Field(0, ge=0, description="Register tokens after the class token (with registers: 4).")
    use_mask_token: bool = Field(True, description="The (training-only) mask token is in the checkpoint.")
    interpolate_antialias: bool = Field(
        False, description="Antialiased bicubic resize of the position table (HF's with-registers model)."
    )

    @property
    def position_grid(self) -> int:
        """Side of the learned position table (HF: sqrt(num_positions))."""
        return self.position_image_size // self.patch_size

    @property
    def swiglu_dim(self) -> int:
        return (int(self.intermediate_size * 2 / 3) + 7) // 8 * 8


class Dinov3VisionConfig(_DinoVisionBase):
    """DINOv3 ViT (`DINOv3ViTModel`): class and register tokens, 2D rotary position embedding on the patch
    tokens (patch-centre coordinates in [-1, 1]), layer scale, a plain or gated MLP, a final LayerNorm;
    `pooler_output` is the normed class token. `image_size` is the side the image processor resizes to."""

    family: Literal["dinov3"] = "dinov3"
    intermediate_size: int = Field(1536, gt=0, description="MLP hidden width.")
    hidden_size: int = Field(384, gt=0, description="Hidden width of the blocks.")
    num_attention_heads: int = Field(6, gt=0, description="Attention heads per block.")
    patch_size: int = Field(16, gt=0, description="Patch side in pixels.")
    hidden_act: Literal["gelu", "silu", "gelu_pytorch_tanh", "quick_gelu"] = Field(
        "gelu", description="MLP activation."
    )
    rope_theta: float = Field(100.0, gt=0, description="Base of the rotary frequencies.")
    query_bias: bool = True
    key_bias: bool = False
    value_bias: bool = True
    proj_bias: bool = True
    mlp_bias: bool = True
    use_gated_mlp: bool = Field(False, description="Gated MLP: down(act(gate(x)) * up(x)).")

    @model_validator(mode="after")
    def _check_rotary(self):
        if self.head_dim % 4:
            raise ValueError(f"head size {self.head_dim} is not a multiple of 4 (2D rotary)")
        return self


VitVisionConfig = ClipVisionConfig | SiglipVisionConfig
QwenVisionConfig = Qwen2VLVisionConfig | Qwen25VLVisionConfig | Qwen3VLVisionConfig
VisionConfig = (
    Qwen2VLVisionConfig
    | Qwen25VLVisionConfig
    | Qwen3VLVisionConfig
    | ClipVisionConfig
    | SiglipVisionConfig
    | Siglip2VisionConfig
    | Dinov2VisionConfig
    | Dinov3VisionConfig
)

_HF_ALIASES = {"in_chans": "in_channels", "spatial_patch_size": "patch_size"}
# the `attribute_map` of transformers' Qwen2-VL .. Qwen3.5 vision configs: these names set num_heads / depth
# (and win over them, as in transformers); CLIP / SigLIP have real fields of these names
_QWEN_ATTRIBUTE_MAP = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
# model types (full VLM and vision tower) of the Qwen3-VL tower; checkpoints written before
# transformers named the vision configs carry the VLM's type in `vision_config` too
_QWEN3_VL_TYPES = {"qwen3_vl", "qwen3_vl_vision", "qwen3_vl_moe", "qwen3_vl_moe_vision"}
_QWEN3_5_TYPES = {"qwen3_5", "qwen3_5_vision", "qwen3_5_moe", "qwen3_5_moe_vision"}


def from_hf_dict(vision: dict, model_type: str | None = None) -> VisionConfig:
    """Config from a Hugging Face `vision_config` dict (or a vision-only `config.json`).

    `model_type` is the top-level model type when the dict came from a full VLM config.
    """
    kinds = {str(vision.get("model_type") or ""), str(model_type or "")}
    # CLIP / SigLIP: the top-level type decides for a full model (a LLaVA config holds a CLIP vision
    # config too, but its tower is read differently), the vision type for a vision model alone
    own = str(model_type or vision.get("model_type") or "")
    if kinds & {"qwen2_5_vl", "qwen2_5_vl_vision"}:
        cls = Qwen25VLVisionConfig
    elif kinds & (_QWEN3_VL_TYPES | _QWEN3_5_TYPES):
        cls = Qwen3VLVisionConfig
    elif kinds & {"qwen2_vl", "qwen2_vl_vision"}:
        cls = Qwen2VLVisionConfig
    elif own in ("clip", "clip_vision_model"):
        cls = ClipVisionConfig
    elif own in ("siglip", "siglip_vision_model"):
        cls = SiglipVisionConfig
    elif own in ("siglip2", "siglip2_vision_model"):
        cls = Siglip2VisionConfig
    elif own in _DINOV2_TYPES:
        return _dinov2_from_hf(vision, own)
    elif own == "dinov3_vit":
        cls = Dinov3VisionConfig
    else:
        raise ConfigError(
            f"unknown model_type {sorted(k for k in kinds if k) or 'missing'}; supported: "
            "qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe (full VLM or vision tower "
            "config.json), clip, siglip, siglip2 (full model, or "
            "CLIPVisionModelWithProjection / SiglipVisionModel / Siglip2VisionModel config.json), dinov2, "
            "dinov2_with_registers, dinov3_vit"
        )
    fields = {_HF_ALIASES.get(k, k): v for k, v in vision.items()}
    if cls in (Qwen2VLVisionConfig, Qwen25VLVisionConfig, Qwen3VLVisionConfig):
        fields |= {name: fields[alias] for alias, name in _QWEN_ATTRIBUTE_MAP.items() if alias in fields}
    rope = fields.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"invalid vision config: rope_parameters must be a JSON object, got {type(rope).__name__}")
    theta = rope.get("rope_theta")
    if theta is not None:
        fields["rope_theta"] = theta
    fullatt = fields.get("fullatt_block_indexes")
    depth = fields.get("depth", Qwen25VLVisionConfig.model_fields["depth"].default)
    if cls is Qwen25VLVisionConfig and isinstance(fullatt, list | tuple) and isinstance(depth, int):
        # transformers gives block i full attention iff `i in fullatt_block_indexes`: indexes past the depth (its
        # default (7, 15, 23, 31) on a shallower tower, as save_pretrained writes it) name no block; dropped
        fields["fullatt_block_indexes"] = [i for i in fullatt if not isinstance(i, int) or 0 <= i < depth]
    if kinds & _QWEN3_5_TYPES:
        # Qwen3.5 towers have no DeepStack mergers whatever the dict says (published configs carry
        # `"deepstack_visual_indexes": []`; HF's Qwen3_5VisionModel never reads the field)
        fields["deepstack_visual_indexes"] = ()
    known = {k: v for k, v in fields.items() if k in cls.model_fields and k != "family"}
    try:
        return cls(**known)
    except ValidationError as exc:
        raise ConfigError(f"invalid vision config: {validation_reason(exc)}") from exc
    except ValueError as exc:
        raise ConfigError(f"invalid vision config: {reason(exc)}") from exc


_DINOV2_TYPES = ("dinov2", "dinov2_with_registers")


def _dinov2_from_hf(vision: dict, model_type: str) -> Dinov2VisionConfig:
    """A DINOv2 config.json: HF's image_size is the position table's; the MLP width is hidden * mlp_ratio."""
    fields = dict(vision)
    hidden = fields.get("hidden_size", Dinov2VisionConfig.model_fields["hidden_size"].default)
    ratio = fields.get("mlp_ratio", 4)
    if "image_size" in fields:
        fields["position_image_size"] = fields.pop("image_size")
    if isinstance(fields.get("position_image_size"), list | tuple):
        size = fields["position_image_size"]
        fields["position_image_size"] = size[0] if len(size) == 2 and size[0] == size[1] else size
    if isinstance(hidden, int) and isinstance(ratio, int | float):
        fields["intermediate_size"] = int(hidden * ratio)
    with_registers = model_type == "dinov2_with_registers"
    fields["num_register_tokens"] = fields.get("num_register_tokens", 4) if with_registers else 0
    fields["interpolate_antialias"] = with_registers
    if with_registers:
        fields["use_mask_token"] = True  # HF's with-registers model always has it
    known = {k: v for k, v in fields.items() if k in Dinov2VisionConfig.model_fields and k != "family"}
    try:
        return Dinov2VisionConfig(**known)
    except ValidationError as exc:
        raise ConfigError(f"invalid vision config: {validation_reason(exc)}") from exc
    except ValueError as exc:
        raise ConfigError(f"invalid vision config: {reason(exc)}") from exc


def attention_kinds(config: VisionConfig) -> tuple[str, ...]:
    """The layer kinds `attention={kind: name}` may name: "full" (every tower), and "window" for a Qwen2.5-VL
    tower with blocks outside `fullatt_block_indexes`. Here, without torch, so a driver checks them too."""
    if isinstance(config, Qwen25VLVisionConfig) and len(set(config.fullatt_block_indexes)) < config.depth:
        return ("full", "window")
    return ("full",)
