"""Text tower configs of the image-text families (CLIP, SigLIP), one pydantic model each.

Field names follow the Hugging Face `text_config` so a checkpoint's `config.json` maps onto them
directly (`text_config_from_hf`). The presets' text configs are in `encoder.loading.presets`
(`TEXT_PRESETS`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from encoder.errors import ConfigError, validation_reason


class _TextBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(49408, gt=0, description="Rows of the token embedding.")
    hidden_size: int = Field(512, gt=0, description="Hidden width of the blocks.")
    intermediate_size: int = Field(2048, gt=0, description="MLP hidden width.")
    num_hidden_layers: int = Field(12, gt=0, description="Number of transformer blocks.")
    num_attention_heads: int = Field(8, gt=0, description="Attention heads per block.")
    max_position_embeddings: int = Field(77, gt=0, description="Tokens per text: every text is padded to it.")
    layer_norm_eps: float = Field(1e-5, gt=0, description="LayerNorm epsilon.")

    @model_validator(mode="after")
    def _check_heads(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        return self

    @property
    def seq_len(self) -> int:
        """Tokens per text, fixed: texts are padded (and truncated) to it."""
        return self.max_position_embeddings

    @property
    def causal(self) -> bool:
        raise NotImplementedError

    @property
    def out_dim(self) -> int:
        """Width of the text embedding (pooling "model")."""
        raise NotImplementedError


class ClipTextConfig(_TextBase):
    """CLIP's text tower with its projection (`CLIPModel.get_text_features`): causal attention, pooled at the
    first EOS token (legacy configs with `eos_token_id` 2: at the highest token id), `text_projection`."""

    family: Literal["clip"] = "clip"
    hidden_act: Literal["quick_gelu", "gelu", "gelu_pytorch_tanh"] = Field("quick_gelu", description="MLP activation.")
    eos_token_id: int = Field(49407, description="The pooled token (2: the legacy rule, the highest id).")
    projection_dim: int = Field(512, gt=0, description="Width of text_embeds (the top-level projection_dim).")

    @property
    def causal(self) -> bool:
        return True

    @property
    def out_dim(self) -> int:
        return self.projection_dim


class SiglipTextConfig(_TextBase):
    """SigLIP's text tower (`SiglipTextModel`): bidirectional attention over the padded text, pooled at the last
    token, then `head` (a linear layer)."""

    family: Literal["siglip"] = "siglip"
    vocab_size: int = Field(32000, gt=0, description="Rows of the token embedding.")
    hidden_size: int = Field(768, gt=0, description="Hidden width of the blocks.")
    intermediate_size: int = Field(3072, gt=0, description="MLP hidden width.")
    num_attention_heads: int = Field(12, gt=0, description="Attention heads per block.")
    max_position_embeddings: int = Field(64, gt=0, description="Tokens per text: every text is padded to it.")
    layer_norm_eps: float = Field(1e-6, gt=0, description="LayerNorm epsilon.")
    hidden_act: Literal["gelu_pytorch_tanh", "gelu", "quick_gelu"] = Field(
        "gelu_pytorch_tanh", description="MLP activation."
    )
    projection_size: int | None = Field(None, gt=0, description="Width of the head's output (None: hidden_size).")
    mask_padding: bool = Field(
        False,
        description="Pads are masked out of attention: SigLIP2, whose processor passes the tokenizer's attention "
        "mask (SigLIP's passes none: every position attends to every other, pads included).",
    )

    @property
    def causal(self) -> bool:
        return False

    @property
    def out_dim(self) -> int:
        return self.projection_size or self.hidden_size


TextConfig = ClipTextConfig | SiglipTextConfig


def text_config_from_hf(raw: dict) -> TextConfig | None:
    """The text tower's config of a full `CLIPModel` / `SiglipModel` / `Siglip2Model` `config.json`; None for a
    checkpoint without one (a vision model alone, a VLM)."""
    model_type = raw.get("model_type")
    text = raw.get("text_config")
    if model_type not in ("clip", "siglip", "siglip2") or not isinstance(text, dict):
        return None
    if isinstance(raw.get("text_config_dict"), dict):  # older CLIP configs: these values win (as in HF)
        text = {**text, **raw["text_config_dict"]}
    cls = ClipTextConfig if model_type == "clip" else SiglipTextConfig
    fields = {k: v for k, v in text.items() if k in cls.model_fields and k != "family" and v is not None}
    if model_type == "siglip2":
        fields["mask_padding"] = True
    if model_type == "clip" and raw.get("projection_dim") is not None:
        fields["projection_dim"] = raw["projection_dim"]  # CLIPModel's text projection: the top-level width
    try:
        return cls(**fields)
    except ValidationError as exc:
        raise ConfigError(f"invalid text config: {validation_reason(exc)}") from exc
    except ValueError as exc:
        raise ConfigError(f"invalid text config: {exc}") from exc
