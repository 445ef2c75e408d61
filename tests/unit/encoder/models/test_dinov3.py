"""The DINOv3 ViT tower against Hugging Face transformers' `DINOv3ViTModel` (float32, CPU): rotary position
embedding, register tokens, layer scale, plain and gated MLPs; poolings, presets and checkpoints written by
`save_pretrained` from tiny random configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import encoder
from encoder.config import Dinov3VisionConfig, from_hf_dict
from encoder.loading.presets import PRESETS
from encoder.patchify import preprocess
from encoder.preprocessing.vit import IMAGENET_MEAN, VitPreprocessConfig
from tests.graph_cases import rel_err
from tests.images_util import random_image

VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, patch_size=16)
CASES = {
    "registers": dict(image_size=80, num_register_tokens=2),
    "gated": dict(image_size=64, use_gated_mlp=True, hidden_act="silu", key_bias=True, proj_bias=False),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (p.dim() == 1))


def to_patches(pixel_values, patch: int) -> torch.Tensor:
    pv = torch.as_tensor(np.asarray(pixel_values))
    n, c, h, w = pv.shape
    gh, gw = h // patch, w // patch
    pv = pv[:, :, : gh * patch, : gw * patch].reshape(n, c, gh, patch, gw, patch)
    return pv.permute(0, 2, 4, 1, 3, 5).reshape(n * gh * gw, c * patch * patch)


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    import transformers as tf

    case = request.param
    directory = tmp_path_factory.mktemp(case)
    model = tf.DINOv3ViTModel(tf.DINOv3ViTConfig(**VISION, **CASES[case]))
    _randomize(model, seed=len(case))
    model.eval().save_pretrained(directory)
    return case, directory, model


def test_tokens_and_pooler_match_hf(checkpoint):
    case, directory, model = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    cfg = enc.config
    assert cfg.family == "dinov3" and enc.default_pooling == "model"
    r = CASES[case].get("num_register_tokens", 0)
    n, s = 4, cfg.image_size
    pixel_values = torch.randn(n, 3, s, s, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(pixel_values=pixel_values)
    ref_tokens, ref_pooled = out.last_hidden_state[:, 1 + r :], out.pooler_output
    batch = encoder.PatchBatch(to_patches(pixel_values, cfg.patch_size), torch.tensor([[1, cfg.grid, cfg.grid]] * n))
    pooled, tokens, means = enc.encode(batch), enc.encode(batch, "none"), enc.encode(batch, "mean")
    normed = enc.encode(batch, "model-l2")
    for i in range(n):
        assert pooled[i].shape == (cfg.hidden_size,) and tokens[i].shape == (cfg.num_patches, cfg.hidden_size)
        assert rel_err(pooled[i], ref_pooled[i]) <= 1e-5
        assert rel_err(tokens[i], ref_tokens[i]) <= 1e-5
        assert rel_err(means[i], ref_tokens[i].mean(0)) <= 1e-5
        assert rel_err(normed[i], ref_pooled[i] / ref_pooled[i].norm()) <= 1e-5
    alone = enc.encode(batch.split([2]))[0]  # attention does not leak across images
    assert rel_err(alone, pooled[2]) <= 1e-6


# published facebook/dinov3-vit*16-pretrain-lvd1689m config.json values
PUBLISHED = {
    "dinov3-vits16": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=6),
    "dinov3-vitb16": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
    "dinov3-vitl16": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_match_hf_sizes(name):
    import transformers as tf

    hf = dict(PUBLISHED[name], image_size=224, patch_size=16, num_register_tokens=4, rope_theta=100.0,
              layer_norm_eps=1e-5, layerscale_value=1e-5)  # fmt: skip
    assert from_hf_dict(dict(hf, model_type="dinov3_vit")) == PRESETS[name]
    with torch.device("meta"):
        expected = sum(p.numel() for p in tf.DINOv3ViTModel(tf.DINOv3ViTConfig(**hf)).parameters())
        ours = sum(p.numel() for p in encoder.api.build_tower(PRESETS[name], None).parameters())
    assert ours == expected


def test_tiny_preset_and_default_preprocessing():
    enc = encoder.load("tiny-dinov3", device="cpu", dtype=torch.float32)
    pp = enc.preprocess_config
    assert isinstance(enc.config, Dinov3VisionConfig)
    assert (pp.height, pp.width, pp.resample, pp.image_mean) == (128, 128, 2, IMAGENET_MEAN)
    images = [np.asarray(random_image("RGB", 90, 150, seed=s)) for s in range(3)]
    out = enc.encode(images)
    assert out[0].shape == (64,) and all(torch.isfinite(x).all() for x in out)
    assert enc.encode(images, "none")[0].shape == (64, 64)
    assert VitPreprocessConfig.from_hf_dict({}, enc.config) == pp


def test_triton_backend_and_bf16_match_float32_sdpa():
    """The Triton varlen kernel (CPU interpreter) over class + register + patch segments; bf16 within 1e-2."""
    from tests.graph_cases import bf16_twin

    ref = encoder.load("tiny-dinov3", device="cpu", dtype=torch.float32)
    tri = encoder.load("tiny-dinov3", device="cpu", dtype=torch.float32, attention="triton")
    images = [random_image("RGB", 60, 80, seed=s) for s in range(2)]
    half = bf16_twin(ref)
    for pooling in ("model", "none"):
        for x, y in zip(tri.encode(images, pooling), ref.encode(images, pooling), strict=True):
            assert rel_err(x, y) <= 1e-5
        for x, y in zip(half.encode(images, pooling), ref.encode(images, pooling), strict=True):
            assert rel_err(x, y) <= 1e-2


def test_input_size_follows_the_image_processor(tmp_path):
    """transformers' DINOv3 runs at whatever size its processor resizes to: a checkpoint whose
    preprocessor_config.json resizes to 96 x 96 (config.json: 64) is a 96-pixel tower, equal to HF there."""
    import json

    import transformers as tf

    model = tf.DINOv3ViTModel(tf.DINOv3ViTConfig(**VISION, **CASES["registers"] | {"image_size": 64}))
    _randomize(model, seed=9)
    model.eval().save_pretrained(tmp_path)
    processor = {"image_processor_type": "DINOv3ViTImageProcessor", "size": {"height": 96, "width": 96}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    enc = encoder.load(str(tmp_path), device="cpu", dtype=torch.float32)
    assert enc.config.image_size == 96 and enc.preprocess_config.output_size == (96, 96)
    pixel_values = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(pixel_values=pixel_values).pooler_output
    batch = encoder.PatchBatch(to_patches(pixel_values, 16), torch.tensor([[1, 6, 6]] * 2))
    for ours, r in zip(enc.encode(batch, "model"), ref, strict=True):
        assert rel_err(ours, r) <= 1e-5


def test_preprocessing_against_float_resize():
    """transformers' DINOv3ViTImageProcessor (torchvision; not installed here) rescales to float, resizes with
    torch's antialiased bilinear interpolate and normalises; ours resizes the 8-bit image with PIL's bilinear
    filter. Equal where no resize is needed; otherwise within about one 8-bit level (0.5 for the rounding)."""
    import torch.nn.functional as F

    pp = VitPreprocessConfig.for_model(PRESETS["dinov3-vitl16"])
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, pp.image_std))
    for seed, (h, w) in enumerate([(224, 224), (300, 517), (1000, 80), (57, 29), (640, 480)]):
        img = np.array(random_image("RGB", h, w, seed=seed))
        x = torch.from_numpy(img).permute(2, 0, 1)[None].float() * (1 / 255)
        x = F.interpolate(x, size=(224, 224), mode="bilinear", antialias=True, align_corners=False)
        ref = to_patches((x - mean) / std, 16)
        diff = (preprocess([img], pp).pixel_values - ref).abs() * std.max() * 255  # in 8-bit levels (at most)
        assert diff.max() <= (1e-3 if (h, w) == (224, 224) else 1.25), (h, w, diff.max())


def test_fuse_is_exact(checkpoint):
    """q/k/v in one GEMM (the key has no bias in DINOv3: zeros there) gives the same outputs."""
    _, directory, _ = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    images = [np.array(random_image("RGB", 70, 90, seed=s)) for s in range(2)]
    before = enc.encode(images, "none")
    enc.model.fuse()
    enc.model.fuse()  # idempotent
    assert all(hasattr(layer.attention, "qkv_proj") for layer in enc.model.layer)
    for x, y in zip(enc.encode(images, "none"), before, strict=True):
        assert rel_err(x, y) <= 1e-6
