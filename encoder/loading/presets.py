"""The named presets: random-weight vision configs, the tiny ones for CPU tests and the CPU service,
the real ones with the sizes of the published checkpoints (`encoder.load(name)`)."""

from __future__ import annotations

from encoder.config import (
    ClipVisionConfig,
    Dinov2VisionConfig,
    Dinov3VisionConfig,
    Qwen2VLVisionConfig,
    Qwen3VLVisionConfig,
    Qwen25VLVisionConfig,
    Siglip2VisionConfig,
    SiglipVisionConfig,
    VisionConfig,
)
from encoder.errors import ConfigError
from encoder.text_config import ClipTextConfig, SiglipTextConfig, TextConfig

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
    # Qwen3-VL / Qwen3.5 (random weights). The tiny one keeps DeepStack on: mergers after blocks 0 and 2
    "tiny-qwen3-vl": Qwen3VLVisionConfig(
        depth=3, num_heads=4, hidden_size=64, intermediate_size=96, out_hidden_size=128,
        num_position_embeddings=64, deepstack_visual_indexes=(0, 2),
    ),
    # published vision_config values (Qwen/<name>-Instruct config.json; sources in
    # tests/unit/encoder/models/test_qwen3_hf.py)
    "qwen3-vl-2b": Qwen3VLVisionConfig(
        depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2048, deepstack_visual_indexes=(5, 11, 17),
    ),
    "qwen3-vl-4b": Qwen3VLVisionConfig(
        depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560, deepstack_visual_indexes=(5, 11, 17),
    ),
    "qwen3-vl-8b": Qwen3VLVisionConfig(out_hidden_size=4096),
    "qwen3-vl-32b": Qwen3VLVisionConfig(out_hidden_size=5120),
    "qwen3-vl-30b-a3b": Qwen3VLVisionConfig(out_hidden_size=2048),
    "qwen3-vl-235b-a22b": Qwen3VLVisionConfig(out_hidden_size=4096),
    # Qwen3.5: the same tower without DeepStack
    "qwen3.5-0.8b": Qwen3VLVisionConfig(
        depth=12, num_heads=12, hidden_size=768, intermediate_size=3072, out_hidden_size=1024,
        deepstack_visual_indexes=(),
    ),
    "qwen3.5-9b": Qwen3VLVisionConfig(out_hidden_size=4096, deepstack_visual_indexes=()),
    "qwen3.5-27b": Qwen3VLVisionConfig(out_hidden_size=5120, deepstack_visual_indexes=()),
    "qwen3.5-35b-a3b": Qwen3VLVisionConfig(out_hidden_size=2048, deepstack_visual_indexes=()),
    # fixed-resolution image-embedding towers (random weights); tiny ones for CPU tests and the CPU service
    "tiny-clip": ClipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=112,
        patch_size=14, projection_dim=48,
    ),
    "tiny-siglip": SiglipVisionConfig(
        hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4, image_size=120,
        patch_size=14,
    ),
    "clip-vit-l-14": ClipVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=224,
        patch_size=14, projection_dim=768, hidden_act="quick_gelu",
    ),
    "siglip-so400m-14-384": SiglipVisionConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=384,
        patch_size=14, hidden_act="gelu_pytorch_tanh",
    ),
    # SigLIP2 NaFlex (variable resolution, packed); vision_config values of google/siglip2-base-patch16-naflex
    # and google/siglip2-so400m-patch16-naflex
    "tiny-siglip2": Siglip2VisionConfig(
        hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4, patch_size=16,
        num_patches=64,
    ),
    "siglip2-base-16-naflex": Siglip2VisionConfig(),
    "siglip2-so400m-16-naflex": Siglip2VisionConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    ),
    # DINOv2 (random weights); published sizes from facebook/dinov2-* config.json (position table 518 px, input
    # 224 px); giant has the SwiGLU MLP
    "tiny-dinov2": Dinov2VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=112,
        patch_size=14, position_image_size=168,
    ),
    "dinov2-small": Dinov2VisionConfig(hidden_size=384, intermediate_size=1536, num_attention_heads=6),
    "dinov2-base": Dinov2VisionConfig(),
    "dinov2-large": Dinov2VisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
    ),
    "dinov2-giant": Dinov2VisionConfig(
        hidden_size=1536, intermediate_size=6144, num_hidden_layers=40, num_attention_heads=24, use_swiglu_ffn=True,
    ),
    "dinov2-with-registers-large": Dinov2VisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        num_register_tokens=4, interpolate_antialias=True,
    ),
    # DINOv3 ViT (random weights); published sizes from facebook/dinov3-vit*16-pretrain-lvd1689m config.json
    "tiny-dinov3": Dinov3VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=128,
        num_register_tokens=2,
    ),
    "dinov3-vits16": Dinov3VisionConfig(num_register_tokens=4),
    "dinov3-vitb16": Dinov3VisionConfig(
        hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_register_tokens=4,
    ),
    "dinov3-vitl16": Dinov3VisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, num_register_tokens=4,
    ),
}  # fmt: skip


def preset(name: str) -> VisionConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None


# the text towers of the image-text presets (random weights; a preset has no tokenizer, so it serves
# images only: `VisionEncoder.supports_text` is False). Published text_config values of
# openai/clip-vit-large-patch14 and google/siglip-so400m-patch14-384.
TEXT_PRESETS: dict[str, TextConfig] = {
    "tiny-clip": ClipTextConfig(
        vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        eos_token_id=511, projection_dim=48,
    ),
    "tiny-siglip": SiglipTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
    ),
    "clip-vit-l-14": ClipTextConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, eos_token_id=2,
        projection_dim=768,
    ),
    "siglip-so400m-14-384": SiglipTextConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    ),
}  # fmt: skip
