"""Tiny Hugging Face Qwen2-VL / Qwen2.5-VL checkpoints written with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch

VISION_25 = dict(
    depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
    fullatt_block_indexes=[1], window_size=112,
)  # fmt: skip
VISION_2 = dict(depth=2, embed_dim=64, hidden_size=48, num_heads=4, mlp_ratio=2)
TEXT = dict(
    hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF initialises norms to one and biases to zero; random values make a swapped weight visible
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1) + (p.dim() == 1)
            )


def vision_model(family: str, seed: int = 0):
    """The HF vision tower (float32, eval) for a family, randomly initialised."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        model = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**VISION_25))
    else:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        model = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**VISION_2))
    _randomize(model, seed)
    return model.eval()


def full_model(family: str, seed: int = 0):
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=VISION_25, text_config=TEXT))
    else:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=VISION_2, text_config=TEXT))
    _randomize(model, seed)
    return model.eval()


def write_checkpoint(directory: Path, family: str, layout: str, seed: int = 0, processor: dict | None = None):
    """Save a tiny checkpoint; returns the HF vision tower holding the same weights.

    layout: "full" (VLM, one model.safetensors), "full-sharded" (VLM, index + shards),
    "vision-sharded" (vision tower alone, index + shards).
    """
    if layout.startswith("full"):
        model = full_model(family, seed)
        tower = model.model.visual
    else:
        model = tower = vision_model(family, seed)
    shard = "60KB" if layout.endswith("sharded") else "1GB"
    model.save_pretrained(directory, max_shard_size=shard)
    if processor is not None:
        import json

        (Path(directory) / "preprocessor_config.json").write_text(json.dumps(processor))
    return tower


def hf_tokens(tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tower(pixel_values, grid_thw=grid_thw).pooler_output
