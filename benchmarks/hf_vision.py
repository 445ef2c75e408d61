"""Hugging Face transformers' twin of one of our image towers, holding the same weights, and the inputs it takes:
what the benchmarks that put HF eager beside our eager and graph paths share (`benchmarks/clip.py`,
`benchmarks/towers.py`).

* `hf_vision_model(enc)`: the transformers model of `enc`'s family (`CLIPVisionModelWithProjection`,
  `SiglipVisionModel`, `Siglip2VisionModel`, `Dinov2Model`, `Dinov2WithRegistersModel`, `DINOv3ViTModel`) built from
  our config, SDPA attention, loading our tower's weights as a checkpoint (the names and shapes
  `encoder.loading.checkpoint.load_weights` reads, so transformers maps them onto its modules itself).
* `hf_pooled(model, inputs)`: the model's own embedding (CLIP `image_embeds`, else `pooler_output`).
* `to_patches(pixels, patch)`: [N, C, S, S] pixels -> our packed rows (C, P, P) (fixed-resolution towers).
* `naflex_inputs(batch, max_patches)`: our packed SigLIP2 rows as transformers' `Siglip2ImageProcessor` hands them to
  the model: `pixel_values` padded with zero rows to `max_num_patches` per image, `pixel_attention_mask`,
  `spatial_shapes` (the rows themselves are equal: `tests/unit/encoder/models/test_siglip2.py`).
"""

from __future__ import annotations

import torch

from encoder.config import (
    ClipVisionConfig,
    Dinov2VisionConfig,
    Dinov3VisionConfig,
    Siglip2VisionConfig,
    SiglipVisionConfig,
)


def hf_config(cfg):
    """(HF config, HF model class) of our vision config `cfg` (random-weight twin; SDPA attention)."""
    import transformers as tf

    fields = cfg.model_dump(exclude={"family"})
    if isinstance(cfg, ClipVisionConfig):
        hf_cfg, cls = tf.CLIPVisionConfig(**fields), tf.CLIPVisionModelWithProjection
    elif isinstance(cfg, SiglipVisionConfig):
        hf_cfg, cls = tf.SiglipVisionConfig(**fields), tf.SiglipVisionModel
    elif isinstance(cfg, Siglip2VisionConfig):
        hf_cfg, cls = tf.Siglip2VisionConfig(**fields), tf.Siglip2VisionModel
    elif isinstance(cfg, Dinov2VisionConfig):
        # HF: image_size is the position table's side, the MLP width hidden * mlp_ratio; the input size is free
        assert cfg.intermediate_size % cfg.hidden_size == 0, "DINOv2's MLP width is an integer multiple of its width"
        kwargs = dict(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                      num_attention_heads=cfg.num_attention_heads, mlp_ratio=cfg.intermediate_size // cfg.hidden_size,
                      hidden_act=cfg.hidden_act, layer_norm_eps=cfg.layer_norm_eps, image_size=cfg.position_image_size,
                      patch_size=cfg.patch_size, num_channels=cfg.num_channels, qkv_bias=cfg.qkv_bias,
                      use_swiglu_ffn=cfg.use_swiglu_ffn)  # fmt: skip
        if cfg.num_register_tokens:
            assert cfg.interpolate_antialias, "HF's DINOv2 with registers resizes its position table antialiased"
            hf_cfg = tf.Dinov2WithRegistersConfig(**kwargs, num_register_tokens=cfg.num_register_tokens)
            cls = tf.Dinov2WithRegistersModel
        else:
            hf_cfg, cls = tf.Dinov2Config(**kwargs, use_mask_token=cfg.use_mask_token), tf.Dinov2Model
    elif isinstance(cfg, Dinov3VisionConfig):
        hf_cfg, cls = tf.DINOv3ViTConfig(**fields), tf.DINOv3ViTModel
    else:
        raise TypeError(f"no transformers twin for {type(cfg).__name__}")
    hf_cfg._attn_implementation = "sdpa"
    return hf_cfg, cls


def checkpoint_state(tower: torch.nn.Module, conv_patches: bool = True) -> dict[str, torch.Tensor]:
    """Our `tower`'s weights as the checkpoint of HF's vision model alone stores them (the names and shapes
    `encoder.loading.checkpoint.load_weights` reads: the tower's first `checkpoint_prefixes` entry; the patch
    embedding as a Conv2d where `conv_patches`, else as our linear, as SigLIP2 NaFlex keeps it)."""
    from encoder.loading.checkpoint import checkpoint_shape

    prefix = getattr(tower, "checkpoint_prefixes", ("",))[0]
    top_level = set(getattr(tower, "checkpoint_top_level", ()))
    state = {}
    for name, value in tower.state_dict().items():
        shape = checkpoint_shape(tower, name, tuple(value.shape)) if conv_patches else value.shape
        state[name if name in top_level else f"{prefix}{name}"] = value.reshape(shape).contiguous()
    return state


def hf_vision_model(enc, device=None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """HF's model of `enc`'s family with `enc`'s weights (eval, SDPA), on `device` in `dtype` (default: `enc`'s).

    Written as a checkpoint (config.json, model.safetensors) to a temporary directory and read back with
    `from_pretrained`, so transformers maps the checkpoint names onto its modules as it does for a published
    checkpoint (its in-memory names differ across versions); every weight must be used and none missing. Copy
    before `workspace.GraphEncoder` fuses the tower (fused layers have other names)."""
    import tempfile

    import transformers
    from safetensors.torch import save_file

    transformers.utils.logging.disable_progress_bar()
    hf_cfg, cls = hf_config(enc.config)
    device = torch.device(device or enc.device)
    state = checkpoint_state(enc.model, conv_patches=not isinstance(enc.config, Siglip2VisionConfig))
    with tempfile.TemporaryDirectory(prefix="hf-twin-") as directory:
        hf_cfg.save_pretrained(directory)
        save_file({k: v.cpu() for k, v in state.items()}, f"{directory}/model.safetensors")
        model, info = cls.from_pretrained(
            directory, dtype=dtype or enc.dtype, attn_implementation="sdpa", output_loading_info=True
        )
    left = [k for k in info.get("missing_keys", ()) if not k.endswith(("position_ids", "inv_freq"))]
    assert not left and not info.get("unexpected_keys") and not info.get("mismatched_keys"), info
    return model.to(device).eval()


def hf_pooled(model, inputs: dict) -> torch.Tensor:
    """The model's own image embedding: CLIP's `image_embeds`, else `pooler_output` (SigLIP's head, DINO's normed
    class token)."""
    out = model(**inputs)
    return out.image_embeds if hasattr(out, "image_embeds") else out.pooler_output


def to_patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, C, H, W] -> our packed float32 rows [N * (H/P) * (W/P), C*P*P] (whole patches only), on their device."""
    n, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels[:, :, : gh * patch, : gw * patch].float().reshape(n, c, gh, patch, gw, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(n * gh * gw, c * patch * patch).contiguous()


def naflex_inputs(batch, max_patches: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A packed SigLIP2 `PatchBatch` as transformers' processor output (`padding` to `max_patches` per image):
    `pixel_values` [N, max_patches, P*P*C] (zero rows after each image's own), `pixel_attention_mask` [N,
    max_patches] int32, `spatial_shapes` [N, 2] int64; on the batch's pixel device, pixels in `dtype`."""
    pv, grid = batch.pixel_values, batch.grid_thw.tolist()
    counts = [h * w for _, h, w in grid]
    assert all(t == 1 for t, _, _ in grid) and max(counts) <= max_patches, (grid, max_patches)
    device = pv.device
    n = len(counts)
    padded = torch.zeros(n, max_patches, pv.shape[1], dtype=dtype or pv.dtype, device=device)
    mask = torch.zeros(n, max_patches, dtype=torch.int32, device=device)
    for i, rows in enumerate(torch.split(pv, counts)):
        padded[i, : counts[i]] = rows
        mask[i, : counts[i]] = 1
    shapes = torch.tensor([[h, w] for _, h, w in grid], dtype=torch.int64, device=device)
    return {"pixel_values": padded, "pixel_attention_mask": mask, "spatial_shapes": shapes}
