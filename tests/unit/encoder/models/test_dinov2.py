"""DINOv2 and DINOv2-with-registers towers against Hugging Face transformers (float32, CPU), their preprocessing
against transformers' BitImageProcessorPil, poolings, presets and checkpoints.

Checkpoints are tiny random `Dinov2Model` / `Dinov2WithRegistersModel`s written by `save_pretrained` with a
processor whose crop differs from the position table's size, so the table is resized (bicubic; antialiased
with registers) as transformers resizes it; the SwiGLU one (giant's MLP) keeps the table's size.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import encoder
from encoder import ConfigError
from encoder.config import Dinov2VisionConfig, from_hf_dict
from encoder.loading.presets import PRESETS, preset
from encoder.patchify import preprocess
from encoder.preprocessing.vit import IMAGENET_MEAN, IMAGENET_STD, VitPreprocessConfig
from tests.graph_cases import rel_err
from tests.images_util import encode, random_image

# 112 px input (8 x 8 patches of 14 px); position tables of 168 px (12 x 12, resized) or 112 px (kept)
VISION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, patch_size=14)
CASES = {
    "dinov2": dict(image_size=168),
    "dinov2_with_registers": dict(image_size=168, num_register_tokens=3),
    "dinov2_swiglu": dict(image_size=112, use_swiglu_ffn=True),
}
CROP = 112


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF initialises norms and layer scales to one and biases to zero; random values make a swap visible
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (p.dim() == 1))


def hf_model(case: str, seed: int = 0):
    import transformers as tf

    kwargs = VISION | CASES[case]
    if case == "dinov2_with_registers":
        model = tf.Dinov2WithRegistersModel(tf.Dinov2WithRegistersConfig(**kwargs))
    else:
        model = tf.Dinov2Model(tf.Dinov2Config(**kwargs))
    _randomize(model, seed)
    return model.eval()


def registers(case: str) -> int:
    return CASES[case].get("num_register_tokens", 0)


@torch.no_grad()
def reference(model, case: str, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(patch tokens [N, L, D], pooler_output [N, D]) of the HF model."""
    out = model(pixel_values=pixel_values)
    return out.last_hidden_state[:, 1 + registers(case) :], out.pooler_output


def hf_processor(**kwargs):
    from transformers.models.bit.image_processing_pil_bit import BitImageProcessorPil

    return BitImageProcessorPil(**kwargs)


def tiny_processor():
    return hf_processor(
        size={"shortest_edge": 128}, crop_size={"height": CROP, "width": CROP}, image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
    )  # fmt: skip


def to_patches(pixel_values, patch: int) -> torch.Tensor:
    pv = torch.as_tensor(np.asarray(pixel_values))
    n, c, h, w = pv.shape
    gh, gw = h // patch, w // patch
    pv = pv[:, :, : gh * patch, : gw * patch].reshape(n, c, gh, patch, gw, patch)
    return pv.permute(0, 2, 4, 1, 3, 5).reshape(n * gh * gw, c * patch * patch)


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    case = request.param
    directory = tmp_path_factory.mktemp(case)
    model = hf_model(case, seed=len(case))
    model.save_pretrained(directory)
    tiny_processor().save_pretrained(directory)
    return case, directory, model


def test_tokens_and_pooler_match_hf(checkpoint):
    case, directory, model = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    cfg = enc.config
    assert cfg.family == "dinov2" and enc.default_pooling == "model"
    assert cfg.image_size == CROP and cfg.num_register_tokens == registers(case)
    assert cfg.position_image_size == CASES[case]["image_size"]
    n = 4
    pixel_values = torch.randn(n, 3, CROP, CROP, generator=torch.Generator().manual_seed(1))
    ref_tokens, ref_pooled = reference(model, case, pixel_values)
    batch = encoder.PatchBatch(to_patches(pixel_values, cfg.patch_size), torch.tensor([[1, cfg.grid, cfg.grid]] * n))
    pooled = enc.encode(batch)  # the default: "model"
    tokens, means = enc.encode(batch, "none"), enc.encode(batch, "mean")
    normed, means_l2 = enc.encode(batch, "model-l2"), enc.encode(batch, "mean-l2")
    for i in range(n):
        assert pooled[i].shape == (enc.out_dim,) == (cfg.hidden_size,)
        assert rel_err(pooled[i], ref_pooled[i]) <= 1e-5
        assert tokens[i].shape == (cfg.num_patches, enc.output_dim("none"))
        assert rel_err(tokens[i], ref_tokens[i]) <= 1e-5
        assert rel_err(means[i], ref_tokens[i].mean(0)) <= 1e-5
        assert rel_err(normed[i], ref_pooled[i] / ref_pooled[i].norm()) <= 1e-5
        mean = ref_tokens[i].mean(0)
        assert rel_err(means_l2[i], mean / mean.norm()) <= 1e-5
    alone = enc.encode(batch.split([2]))[0]  # attention does not leak across images
    assert rel_err(alone, pooled[2]) <= 1e-6


def test_fuse_computes_the_resized_positions_once(checkpoint, monkeypatch):
    """After `fuse()` the forward reads the position rows resized once (the interpolation no longer runs per
    forward: on CUDA it cost ~1.8 ms of a one-image replay); every output is bit-equal."""
    case, directory, _ = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    cfg = enc.config
    # two cases resize the table (position grid 12 -> 16), the SwiGLU one keeps it (8 = 8)
    pixel_values = torch.randn(3, 3, CROP, CROP, generator=torch.Generator().manual_seed(2))
    batch = encoder.PatchBatch(to_patches(pixel_values, cfg.patch_size), torch.tensor([[1, cfg.grid, cfg.grid]] * 3))
    before = enc.encode(batch, "none") + enc.encode(batch)
    enc.model.fuse()
    assert enc.model.embeddings.frozen_positions.dtype == torch.float32
    assert "frozen_positions" not in enc.model.state_dict()  # not a checkpoint entry

    def no_interpolation(*args, **kwargs):
        raise AssertionError("the position table was resized again")

    monkeypatch.setattr(torch.nn.functional, "interpolate", no_interpolation)
    after = enc.encode(batch, "none") + enc.encode(batch)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_images_end_to_end_match_hf(checkpoint):
    """Encoded images -> our preprocess + tower against HF's processor + model (preprocessor_config.json read)."""
    case, directory, model = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    images = [random_image("RGB", 70, 95, seed=1), random_image("RGBA", 200, 61, seed=2), random_image("L", 33, 33, 3)]
    data = [encode(img, "PNG") for img in images]
    opened = [Image.open(io.BytesIO(d)) for d in data]
    hf_pixels = tiny_processor()(images=opened, return_tensors="pt")["pixel_values"]
    batch = enc.preprocess(data)
    assert np.abs(batch.pixel_values.numpy() - to_patches(hf_pixels, enc.config.patch_size).numpy()).max() <= 1e-5
    ref_tokens, ref_pooled = reference(model, case, hf_pixels)
    for ours, ref in zip(enc.encode(data, "model"), ref_pooled, strict=True):
        assert rel_err(ours, ref) <= 1e-5
    for ours, ref in zip(enc.encode(data, "none"), ref_tokens, strict=True):
        assert rel_err(ours, ref) <= 1e-5


SIZES = [(224, 224), (10, 10), (300, 517), (517, 300), (1000, 80), (257, 256), (57, 29)]


def test_published_preprocessing_matches_hf():
    """The family default (the published facebook/dinov2-* processor: shortest edge 256, crop 224, ImageNet
    mean/std) against BitImageProcessorPil with those settings, over sizes that round differently."""
    pp = VitPreprocessConfig.for_model(preset("dinov2-base"))
    assert (pp.shortest_edge, pp.crop_height, pp.image_mean) == (256, 224, IMAGENET_MEAN)
    processor = hf_processor(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
    )  # fmt: skip
    images = [np.asarray(random_image("RGB", h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]
    ours = preprocess(images, pp)
    ref = to_patches(processor(images=images, return_tensors="np")["pixel_values"], 14).numpy()
    assert np.abs(ours.pixel_values.numpy() - ref).max() <= 1e-5
    assert ours.grid_thw.tolist() == [[1, 16, 16]] * len(images)


def test_processor_defaults_are_bit_image_processor():
    """Keys a preprocessor_config.json lacks take BitImageProcessorPil's defaults (CLIP mean/std, bicubic)."""
    cfg = preset("tiny-dinov2")
    pp = VitPreprocessConfig.from_hf_dict({"crop_size": {"height": 112, "width": 112}}, cfg)
    hf = hf_processor(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112})
    images = [np.asarray(random_image("RGB", 90, 130, seed=5))]
    ref = to_patches(hf(images=images, return_tensors="np")["pixel_values"], 14).numpy()
    assert np.abs(preprocess(images, pp).pixel_values.numpy() - ref).max() <= 1e-5
    with pytest.raises(ConfigError, match="model takes 112x112"):
        VitPreprocessConfig.from_hf_dict({"crop_size": {"height": 224, "width": 224}}, cfg)


# ------------------------------------------------------------------------------------------ configs, presets

# published facebook/dinov2-* config.json values (position tables of 518 px, patch 14)
PUBLISHED = {
    "dinov2-small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6),
    "dinov2-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
    "dinov2-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16),
    "dinov2-giant": dict(hidden_size=1536, num_hidden_layers=40, num_attention_heads=24, use_swiglu_ffn=True),
    "dinov2-with-registers-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_match_hf_sizes(name):
    """Each preset equals the config read from its published config.json and has transformers' parameter count."""
    import transformers as tf

    registers = name.startswith("dinov2-with-registers")
    hf = dict(PUBLISHED[name], image_size=518, patch_size=14, mlp_ratio=4, model_type="dinov2")
    if registers:
        hf |= dict(model_type="dinov2_with_registers", num_register_tokens=4)
    assert from_hf_dict(hf) == PRESETS[name]
    kwargs = {k: v for k, v in hf.items() if k != "model_type"}
    config = tf.Dinov2WithRegistersConfig(**kwargs) if registers else tf.Dinov2Config(**kwargs)
    cls = tf.Dinov2WithRegistersModel if registers else tf.Dinov2Model
    with torch.device("meta"):
        expected = sum(p.numel() for p in cls(config).parameters())
        ours = sum(p.numel() for p in encoder.api.build_tower(PRESETS[name], None).parameters())
    assert ours == expected


def test_tiny_preset_runs_and_is_deterministic():
    a = encoder.load("tiny-dinov2", device="cpu", dtype=torch.float32)
    b = encoder.load("tiny-dinov2", device="cpu", dtype=torch.float32)
    images = [np.asarray(random_image("RGB", 80, 120, seed=s)) for s in range(3)]
    out_a, out_b = a.encode(images), b.encode(images)
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b, strict=True))
    assert out_a[0].shape == (64,) and a.encode(images, "none")[0].shape == (64, 64)
    assert all(torch.isfinite(x).all() for x in out_a)


def test_config_errors():
    with pytest.raises(ConfigError, match="invalid vision config"):
        from_hf_dict({"model_type": "dinov2", "hidden_size": 65, "num_attention_heads": 4})
    assert isinstance(from_hf_dict({"model_type": "dinov2"}), Dinov2VisionConfig)
    assert from_hf_dict({"model_type": "dinov2_with_registers"}).num_register_tokens == 4


def test_triton_backend_and_bf16_match_float32_sdpa():
    """The Triton varlen kernel (CPU interpreter) over class + register + patch segments; bf16 within 1e-2."""
    from tests.graph_cases import bf16_twin

    ref = encoder.load("tiny-dinov2", device="cpu", dtype=torch.float32)
    tri = encoder.load("tiny-dinov2", device="cpu", dtype=torch.float32, attention="triton")
    images = [random_image("RGB", 60, 80, seed=s) for s in range(2)]
    half = bf16_twin(ref)
    for pooling in ("model", "none"):
        for x, y in zip(tri.encode(images, pooling), ref.encode(images, pooling), strict=True):
            assert rel_err(x, y) <= 1e-5
        for x, y in zip(half.encode(images, pooling), ref.encode(images, pooling), strict=True):
            assert rel_err(x, y) <= 1e-2


@pytest.mark.parametrize("case", ["dinov2", "dinov2_with_registers"])
def test_image_classifier_checkpoint_loads_its_backbone(case, tmp_path):
    """A `*ForImageClassification` checkpoint: the backbone under `dinov2.` / `dinov2_with_registers.`, the
    classifier not read."""
    import transformers as tf

    kwargs = VISION | CASES[case] | {"num_labels": 3}
    if case == "dinov2":
        model = tf.Dinov2ForImageClassification(tf.Dinov2Config(**kwargs))
    else:
        model = tf.Dinov2WithRegistersForImageClassification(tf.Dinov2WithRegistersConfig(**kwargs))
    _randomize(model, seed=7)
    model.eval().save_pretrained(tmp_path)
    tiny_processor().save_pretrained(tmp_path)
    enc = encoder.load(str(tmp_path), device="cpu", dtype=torch.float32)
    pixel_values = torch.randn(2, 3, CROP, CROP, generator=torch.Generator().manual_seed(4))
    backbone = model.dinov2 if case == "dinov2" else model.dinov2_with_registers
    ref_tokens, ref_pooled = reference(backbone, case, pixel_values)
    g = enc.config.grid
    batch = encoder.PatchBatch(to_patches(pixel_values, 14), torch.tensor([[1, g, g]] * 2))
    for ours, ref in zip(enc.encode(batch, "model"), ref_pooled, strict=True):
        assert rel_err(ours, ref) <= 1e-5
