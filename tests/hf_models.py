"""Tiny Hugging Face Qwen VLM checkpoints written with `save_pretrained`.

Families: "qwen2_vl", "qwen2_5_vl", and the Qwen3 ones (`QWEN3_FAMILIES`): "qwen3_vl" (DeepStack
after vision blocks 0 and 2), "qwen3_vl_moe", "qwen3_5" and "qwen3_5_moe" (no DeepStack;
linear-attention LLM). `full_model(family, seed)` is the whole VLM (float32, eval, random weights,
image token id `IMAGE_TOKEN` inside the tiny vocabulary), `vision_model(family, seed)` its tower
alone, `write_checkpoint(directory, family, layout, seed)` saves one and returns its tower.
"""

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


QWEN3_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# patch 16, an 8 x 8 learned position grid, 16-dim heads; DeepStack after blocks 0 and 2 (Qwen3-VL)
VISION_3 = dict(
    depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, num_position_embeddings=64,
)  # fmt: skip
DEEPSTACK = [0, 2]
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 100, 101, 102, 103
_TOKENS = dict(
    image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
)  # fmt: skip
# two decoder layers so both DeepStack features reach the LLM; M-RoPE sections sum to head_dim / 2
TEXT_3 = dict(
    hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True},
)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Qwen3.5: one linear-attention (gated delta net) layer, one full-attention layer; rotary on a
# quarter of the head (partial_rotary_factor 0.25): sections sum to 32 * 0.25 / 2
TEXT_35 = dict(
    TEXT_3, head_dim=32, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                     "mrope_interleaved": True, "partial_rotary_factor": 0.25},
)  # fmt: skip


def _qwen3_classes(family: str):
    """(config class, VLM class, vision config class, vision model class) of a Qwen3 family."""
    import transformers as tf

    names = {
        "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
        "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeVisionConfig",
                         "Qwen3VLMoeVisionModel"),
        "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
        "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeVisionConfig",
                        "Qwen3_5MoeVisionModel"),
    }[family]  # fmt: skip
    return tuple(getattr(tf, n) for n in names)


def qwen3_vision_config(family: str) -> dict:
    return VISION_3 if family.startswith("qwen3_5") else dict(VISION_3, deepstack_visual_indexes=DEEPSTACK)


def qwen3_text_config(family: str) -> dict:
    text = TEXT_35 if family.startswith("qwen3_5") else TEXT_3
    if family.endswith("_moe"):
        text = dict(text, **_MOE)
        if family == "qwen3_5_moe":
            text["shared_expert_intermediate_size"] = 32
    return text


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
    if family in QWEN3_FAMILIES:
        _, _, vision_cfg, vision_cls = _qwen3_classes(family)
        model = vision_cls(vision_cfg(**qwen3_vision_config(family)))
    elif family == "qwen2_5_vl":
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
    """The whole HF VLM (float32, eval) for a family, randomly initialised; its tower is `model.model.visual`."""
    if family in QWEN3_FAMILIES:
        config_cls, model_cls, _, _ = _qwen3_classes(family)
        config = config_cls(vision_config=qwen3_vision_config(family), text_config=qwen3_text_config(family), **_TOKENS)
        model = model_cls(config)
    elif family == "qwen2_5_vl":
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


def hf_features(tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(merger tokens [n, out_dim], DeepStack features, each [n, out_dim]) of an HF Qwen3 tower."""
    with torch.no_grad():
        out = tower(pixel_values, grid_thw=grid_thw)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def check_norms_on_small_activations(hf_tower: torch.nn.Module, ours: torch.nn.Module) -> int:
    """Every norm of `hf_tower` (LayerNorm, or RMSNorm: `variance_epsilon`) against ours of the same name, as our
    towers apply it (`kernels.add_norm`), on activations of RMS 1e-3: there eps (1e-6; CLIP 1e-5) is a visible
    share of the variance, so a wrong eps (a default) fails, where on unit-scale activations it moves the
    outputs by less than the tolerances. Returns how many norms were checked."""
    from encoder.kernels.elementwise import add_norm
    from encoder.models.layers import norm_args

    gen = torch.Generator().manual_seed(4)
    norms = [
        (n, m)
        for n, m in hf_tower.named_modules()
        if isinstance(m, torch.nn.LayerNorm) or hasattr(m, "variance_epsilon")
    ]
    for name, norm in norms:
        x = torch.randn(5, norm.weight.shape[0], generator=gen) * 1e-3
        _, got = add_norm(x, None, *norm_args(ours.get_submodule(name)))
        with torch.no_grad():
            ref = norm(x).double()
        assert ((got.double() - ref).norm() / ref.norm()).item() <= 1e-5, name
    return len(norms)
