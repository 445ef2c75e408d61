"""CLIP and SigLIP towers against Hugging Face transformers (float32, CPU), their preprocessing against
transformers' PIL image processors, poolings and checkpoints. The graph runner (eager on CPU) and the batch path
are in `test_clip_siglip_runner.py`.

Checkpoints are tiny models written by `save_pretrained`, in both layouts: the full CLIPModel /
SiglipModel (text tower included, not read) and the vision model alone.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import encoder
from encoder import CheckpointError, ConfigError, InvalidArgumentError
from encoder.config import ClipVisionConfig, SiglipVisionConfig
from encoder.loading.presets import preset
from encoder.patchify import preprocess
from encoder.preprocessing.families import preprocess_config_from_dump
from encoder.preprocessing.vit import VitPreprocessConfig
from tests.graph_cases import rel_err
from tests.hf_models import check_norms_on_small_activations
from tests.images_util import encode, random_image

# tiny towers: CLIP 4x4 patches + class token; SigLIP 60 px with 14 px patches (the last 4 px unused,
# as SigLIP-384 with 14 px patches leaves 6) and an MLP width that is not a multiple of 128
CLIP_VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   image_size=56, patch_size=14)  # fmt: skip
SIGLIP_VISION = dict(hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                     image_size=60, patch_size=14)  # fmt: skip
TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
            max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
FAMILIES = ["clip", "siglip"]
LAYOUTS = ["full", "vision", "full-sharded"]  # sharded: index + shards, the text tower's among them


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF initialises norms to one and biases to zero; random values make a swapped weight visible
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (p.dim() == 1))


def hf_model(family: str, layout: str, seed: int = 0, hidden_act: str | None = None):
    """(model to save, function pixel_values [N, 3, S, S] -> (patch tokens [N, L, D], embeddings [N, E]))."""
    import transformers as tf

    if family == "clip":
        vision = CLIP_VISION | {"hidden_act": hidden_act or "quick_gelu"}
        if layout == "full":
            model = tf.CLIPModel(tf.CLIPConfig(vision_config=vision, text_config=TEXT, projection_dim=24))
        else:
            model = tf.CLIPVisionModelWithProjection(tf.CLIPVisionConfig(**vision, projection_dim=24))
    else:
        vision = SIGLIP_VISION | ({"hidden_act": hidden_act} if hidden_act else {})
        if layout == "full":
            model = tf.SiglipModel(tf.SiglipConfig(vision_config=vision, text_config=TEXT))
        else:
            model = tf.SiglipVisionModel(tf.SiglipVisionConfig(**vision))
    _randomize(model, seed)
    model.eval()

    @torch.no_grad()
    def reference(pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if family == "clip":
            tower = model.vision_model
            out = tower(pixel_values=pixel_values)
            return out.last_hidden_state[:, 1:], model.visual_projection(out.pooler_output)
        tower = model.vision_model if layout == "full" else model
        out = tower(pixel_values=pixel_values)
        return out.last_hidden_state, out.pooler_output

    return model, reference


def hf_processor(family: str, **kwargs):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    return (CLIPImageProcessorPil if family == "clip" else SiglipImageProcessorPil)(**kwargs)


def tiny_processor(family: str):
    """The processor of the tiny checkpoints (their image size)."""
    if family == "clip":
        return hf_processor("clip", size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    return hf_processor("siglip", size={"height": 60, "width": 60})


def to_patches(pixel_values: torch.Tensor | np.ndarray, patch: int) -> torch.Tensor:
    """HF pixel_values [N, 3, H, W] -> our packed patches [N * gh * gw, 3*P*P] (whole patches only,
    as the Conv2d patch embedding reads them)."""
    pv = torch.as_tensor(np.asarray(pixel_values))
    n, c, h, w = pv.shape
    gh, gw = h // patch, w // patch
    pv = pv[:, :, : gh * patch, : gw * patch].reshape(n, c, gh, patch, gw, patch)
    return pv.permute(0, 2, 4, 1, 3, 5).reshape(n * gh * gw, c * patch * patch)


@pytest.fixture(scope="module", params=[(f, lay) for f in FAMILIES for lay in LAYOUTS], ids=lambda p: "-".join(p))
def checkpoint(request, tmp_path_factory):
    family, layout = request.param
    directory = tmp_path_factory.mktemp(f"{family}-{layout}")
    # the vision-only CLIP uses exact GELU: both CLIP activations are covered
    act = "gelu" if (family, layout) == ("clip", "vision") else None
    model, reference = hf_model(family, layout.removesuffix("-sharded"), seed=len(family) + len(layout), hidden_act=act)
    model.save_pretrained(directory, max_shard_size="40KB" if layout.endswith("sharded") else "1GB")
    assert (directory / "model.safetensors.index.json").exists() == layout.endswith("sharded")
    tiny_processor(family).save_pretrained(directory)
    return family, directory, reference


# ------------------------------------------------------------------------------------------ towers vs HF


def test_embeddings_match_hf(checkpoint):
    family, directory, reference = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    cfg = enc.config
    assert cfg.family == family and enc.default_pooling == "model"
    n = 5
    pixel_values = torch.randn(n, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(1))
    ref_tokens, ref_embeds = reference(pixel_values)
    batch = encoder.PatchBatch(to_patches(pixel_values, cfg.patch_size), torch.tensor([[1, cfg.grid, cfg.grid]] * n))
    model = enc.encode(batch)  # the default: "model"
    tokens, means = enc.encode(batch, "none"), enc.encode(batch, "mean")
    normed = enc.encode(batch, "model-l2")
    for i in range(n):
        assert model[i].shape == (enc.out_dim,) == (enc.output_dim("model"),)
        assert rel_err(model[i], ref_embeds[i]) <= 1e-5
        assert tokens[i].shape == (cfg.num_patches, enc.output_dim("none"))
        assert rel_err(tokens[i], ref_tokens[i]) <= 1e-5
        assert rel_err(means[i], ref_tokens[i].mean(0)) <= 1e-5
        assert rel_err(normed[i], ref_embeds[i] / ref_embeds[i].norm()) <= 1e-5
        assert abs(normed[i].norm().item() - 1) <= 1e-6
    # each image alone equals the packed batch: attention does not leak across images
    alone = enc.encode(batch.split([3]))[0]
    assert rel_err(alone, model[3]) <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_match_hf_on_small_activations(family, tmp_path):
    """`check_norms_on_small_activations`, and SigLIP's pooling head whole with its attention output as small
    (out_proj x 1e-3, in both): its LayerNorm is applied in the head's forward."""
    model, _ = hf_model(family, "full", seed=3)
    tower = model.vision_model
    with torch.no_grad():
        for p in tower.head.attention.out_proj.parameters() if family == "siglip" else ():
            p.mul_(1e-3)
    model.save_pretrained(tmp_path)
    ours = encoder.load(str(tmp_path), device="cpu", dtype=torch.float32).model
    assert check_norms_on_small_activations(tower, ours) == 2 * ours.cfg.depth + 2
    tokens = torch.randn(3, ours.cfg.seq_len, ours.cfg.width, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert family == "clip" or rel_err(ours.head(tokens), tower.head(tokens)) <= 1e-5


def test_images_end_to_end_match_hf(checkpoint):
    """Encoded images -> our preprocess + tower against HF's processor + model (preprocessor_config.json read)."""
    family, directory, reference = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    images = [random_image("RGB", 70, 95, seed=1), random_image("RGBA", 200, 61, seed=2), random_image("L", 33, 33, 3)]
    data = [encode(img, "PNG") for img in images]
    opened = [Image.open(io.BytesIO(d)) for d in data]
    hf_pixels = tiny_processor(family)(images=opened, return_tensors="pt")["pixel_values"]
    batch = enc.preprocess(data)
    assert np.abs(batch.pixel_values.numpy() - to_patches(hf_pixels, enc.config.patch_size).numpy()).max() <= 1e-5
    _, ref_embeds = reference(hf_pixels)
    for ours, ref in zip(enc.encode(data, "model"), ref_embeds, strict=True):
        assert rel_err(ours, ref) <= 1e-5


# ------------------------------------------------------------------------------------------ preprocessing


def assert_preprocess_matches(images, pp: VitPreprocessConfig, processor) -> None:
    ours = preprocess(images, pp)
    hf = processor(images=images, return_tensors="np")["pixel_values"]
    ref = to_patches(hf, pp.patch_size).numpy()
    assert ours.pixel_values.dtype == torch.float32 and ours.pixel_values.shape == ref.shape
    assert np.abs(ours.pixel_values.numpy() - ref).max() <= 1e-5
    g = pp.output_size[0] // pp.patch_size
    assert ours.grid_thw.tolist() == [[1, g, g]] * len(images)


SIZES = [(224, 224), (10, 10), (300, 517), (517, 300), (1000, 80), (225, 224), (57, 29), (1400, 1300)]


@pytest.mark.parametrize("family", FAMILIES)
def test_real_size_preprocessing_matches_hf(family):
    """The presets' preprocessing (CLIP 224 shortest edge + crop; SigLIP 384 square, 378 used) against the
    default PIL processors, over sizes that round differently, upscale and downscale."""
    name = "clip-vit-l-14" if family == "clip" else "siglip-so400m-14-384"
    pp = VitPreprocessConfig.for_model(preset(name))
    processor = hf_processor("clip") if family == "clip" else hf_processor("siglip", size={"height": 384, "width": 384})
    images = [random_image("RGB", h, w, seed=h + w) for h, w in SIZES]
    assert_preprocess_matches(images, pp, processor)
    assert pp.output_size == ((224, 224) if family == "clip" else (378, 378))


@pytest.mark.parametrize("mode", ["RGBA", "P", "CMYK"])  # not I;16: our rule, not HF's (test_image_modes.py)
def test_modes_match_hf(mode):
    img = random_image(mode, 150, 97, seed=7)
    assert_preprocess_matches([img], VitPreprocessConfig.for_model(preset("clip-vit-l-14")), hf_processor("clip"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": 50, "crop_size": 56},  # old-style int sizes; the crop is larger than the resize: zero padding
        {"size": {"shortest_edge": 64}, "crop_size": {"height": 56, "width": 56}, "resample": 2},  # bilinear
        {"size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 60}, "image_mean": 0.5},  # wide crop
    ],
    ids=["pad", "bilinear", "wide-crop"],
)
def test_preprocessor_config_variants_match_hf(kwargs, tmp_path):
    processor = hf_processor("clip", **kwargs)
    processor.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "preprocessor_config.json").read_text())
    # 56 px model: the 60 px wide crop is 4 whole patches too (the last 4 px unused)
    pp = VitPreprocessConfig.from_hf_dict(raw, ClipVisionConfig(**CLIP_VISION, projection_dim=24))
    images = [random_image("RGB", h, w, seed=h) for h, w in [(40, 90), (120, 33), (56, 56), (200, 300)]]
    assert_preprocess_matches(images, pp, processor)


def test_preprocessor_config_defaults_and_errors():
    clip = ClipVisionConfig(**CLIP_VISION, projection_dim=24)
    siglip = SiglipVisionConfig(**SIGLIP_VISION)
    # keys a config lacks take the family's rule at the model's size
    assert VitPreprocessConfig.from_hf_dict({}, clip) == VitPreprocessConfig.for_model(clip)
    assert VitPreprocessConfig.from_hf_dict({}, siglip) == VitPreprocessConfig.for_model(siglip)
    # a null crop_size is an absent one, as a null size is (it was a TypeError: set(None))
    assert VitPreprocessConfig.from_hf_dict({"crop_size": None}, clip) == VitPreprocessConfig.for_model(clip)
    crop = VitPreprocessConfig.from_hf_dict({"do_center_crop": True, "crop_size": None}, siglip)
    assert (crop.crop_height, crop.crop_width) == (60, 60)
    bad = [
        ({"do_normalize": False}, "do_normalize=false"),
        ({"do_pad": True}, "do_pad"),
        ({"rescale_factor": 0.5}, "rescale_factor"),
        ({"rescale_factor": "1/255"}, "unsupported rescale_factor '1/255'"),  # was a TypeError
        ({"size": {"shortest_edge": 56, "longest_edge": 90}}, "unsupported preprocessor size"),
        ({"size": {"shortest_edge": 112}, "crop_size": 112}, "the model takes 56x56"),
        ({"resample": 9}, "resample"),
        ({"image_mean": "grey"}, "image_mean"),  # a ValueError from float() before
        ({"image_std": {"r": 0.5}}, "image_std"),  # a TypeError
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            VitPreprocessConfig.from_hf_dict(raw, clip)
    with pytest.raises(ConfigError, match="varying size"):
        VitPreprocessConfig.from_hf_dict({"size": 60}, siglip)  # shortest edge, no crop


def test_preprocess_errors_and_limits():
    pp = VitPreprocessConfig.for_model(preset("tiny-clip"))
    with pytest.raises(encoder.ImageDecodeError, match="image 1"):
        preprocess([encode(random_image("RGB", 20, 20), "PNG"), b"garbage"], pp)
    with pytest.raises(encoder.InvalidImageError, match="aspect ratio"):
        preprocess(np.zeros((1, 300, 3), dtype=np.uint8), pp)
    small = pp.model_copy(update={"max_image_pixels": 100})
    with pytest.raises(encoder.ImageTooLargeError):
        preprocess(encode(random_image("RGB", 20, 20), "PNG"), small)
    # SigLIP resizes to a square: any aspect ratio is accepted, as in transformers
    preprocess(np.zeros((1, 300, 3), dtype=np.uint8), VitPreprocessConfig.for_model(preset("tiny-siglip")))
    # the serialised form round-trips and is told apart from the Qwen config
    assert preprocess_config_from_dump(pp.model_dump(mode="json")) == pp
    assert type(preprocess_config_from_dump(encoder.load("tiny", device="cpu").preprocess_config.model_dump())) is (
        encoder.preprocessing.qwen.PreprocessConfig
    )


def test_service_patchify_equals_preprocess():
    """The service's path (uint8 arrays stacked, patchified on the device) gives the same patches."""
    from encoder.patchify import patchify
    from encoder.preprocessing.images import load_image
    from encoder.preprocessing.vit import resize_crop

    pp = VitPreprocessConfig.for_model(preset("tiny-siglip"))
    images = [random_image("RGB", h, w, seed=h) for h, w in [(90, 40), (120, 120), (33, 200)]]
    arrays = [pp.resize(load_image(img, pp)) for img in images]
    assert all(np.array_equal(a, resize_crop(img, pp)) for a, img in zip(arrays, images, strict=True))
    assert all(a.shape == (112, 112, 3) and a.shape[0] % pp.factor == 0 for a in arrays)
    stacked = patchify(torch.from_numpy(np.concatenate(arrays)), pp)
    assert torch.equal(stacked, preprocess(images, pp).pixel_values)
    assert pp.num_patches(5000, 10) == pp.num_patches(10, 5000) == 64 == pp.max_pixels // pp.patch_size**2


# ------------------------------------------------------------------------------------------ poolings, API


def test_pooling_names_and_defaults():
    clip = encoder.load("tiny-clip", device="cpu")
    qwen = encoder.load("tiny", device="cpu")
    assert clip.default_pooling == "model" and qwen.default_pooling == "none"
    assert clip.output_dim("model") == 48 and clip.output_dim("mean") == clip.output_dim("none") == 64
    assert qwen.output_dim("mean-l2") == qwen.out_dim
    images = [random_image("RGB", 50, 70, seed=3)]
    with pytest.raises(InvalidArgumentError, match="needs a model with its own image embedding"):
        qwen.encode(images, "model")
    with pytest.raises(InvalidArgumentError, match="unknown pooling"):
        clip.encode(images, "max")
    mean, mean_l2 = qwen.encode(images, "mean")[0], qwen.encode(images, "mean-l2")[0]
    assert torch.allclose(mean_l2, mean / mean.norm(), atol=1e-6)
    assert qwen.encode(images)[0].dim() == 2  # Qwen keeps its default: every token
    bad = encoder.PatchBatch(torch.zeros(32, clip.config.patch_dim), torch.tensor([[1, 4, 8]]))
    with pytest.raises(InvalidArgumentError, match="112x112-pixel images only"):
        clip.encode(bad)


def test_presets_match_hf_sizes():
    """Real-size presets have HF's parameter count (built on the meta device: no memory, no init)."""
    import transformers as tf

    from encoder.attention import get_backend
    from encoder.models.vit import build_vit_tower

    hf_configs = {
        "clip-vit-l-14": lambda: tf.CLIPVisionModelWithProjection(tf.CLIPVisionConfig(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=224,
            patch_size=14, projection_dim=768)),
        "siglip-so400m-14-384": lambda: tf.SiglipVisionModel(tf.SiglipVisionConfig(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=384,
            patch_size=14)),
    }  # fmt: skip
    for name, build in hf_configs.items():
        with torch.device("meta"):
            ours = build_vit_tower(preset(name), get_backend("sdpa"))
            theirs = build()
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()), name
        theirs_keys = {k.removeprefix("vision_model.") for k in theirs.state_dict() if "position_ids" not in k}
        assert set(ours.state_dict()) == theirs_keys, name
    assert preset("clip-vit-l-14").num_patches == 256 and preset("siglip-so400m-14-384").num_patches == 729


def test_random_presets_are_deterministic_and_padding_is_exact():
    a, b = encoder.load("tiny-siglip", device="cpu"), encoder.load("tiny-siglip", device="cpu")
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    images = [random_image("RGB", 64, 64, seed=s) for s in range(3)]
    before = {p: a.encode(images, p) for p in ("model", "none")}
    a.model.fuse(128)  # MLP 136 -> 256 zero-padded, q/k/v fused (new modules)
    assert a.model.blocks[0].mlp.fc1.out_features == 256 and hasattr(a.model.blocks[0].self_attn, "qkv_proj")
    a.model.fuse(128)  # idempotent
    assert a.model.blocks[0].mlp.fc1.out_features == 256
    for pooling, outs in before.items():
        for x, y in zip(a.encode(images, pooling), outs, strict=True):
            assert rel_err(x, y) <= 1e-6


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-siglip"])
def test_triton_backend_matches_sdpa(name):
    """The Triton varlen kernel (CPU interpreter) over fixed-length image segments."""
    ref = encoder.load(name, device="cpu")
    tri = encoder.load(name, device="cpu", attention="triton")
    images = [random_image("RGB", 60, 80, seed=s) for s in range(2)]
    for x, y in zip(tri.encode(images, "none"), ref.encode(images, "none"), strict=True):
        assert rel_err(x, y) <= 1e-5


# ------------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_errors(tmp_path):
    import transformers as tf
    from safetensors.torch import load_file, save_file

    # CLIPVisionModel has no projection: no image_embeds
    tf.CLIPVisionModel(tf.CLIPVisionConfig(**CLIP_VISION)).save_pretrained(tmp_path / "noproj")
    with pytest.raises(CheckpointError, match="visual_projection.weight.*CLIPVisionModelWithProjection"):
        encoder.load(str(tmp_path / "noproj"), device="cpu")
    model, _ = hf_model("siglip", "full")
    model.save_pretrained(tmp_path / "s")
    state = load_file(tmp_path / "s" / "model.safetensors")
    del state["vision_model.head.probe"]
    state["vision_model.head.extra"] = torch.ones(2)
    save_file(state, tmp_path / "s" / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected vision weights.*vision_model.head.extra"):
        encoder.load(str(tmp_path / "s"), device="cpu")
    del state["vision_model.head.extra"]
    save_file(state, tmp_path / "s" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing vision weights \(1\): head.probe"):
        encoder.load(str(tmp_path / "s"), device="cpu")
    # older CLIP configs: `vision_config_dict` overrides `vision_config`, as in transformers
    model, _ = hf_model("clip", "full")
    model.save_pretrained(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["vision_config_dict"] = {"num_hidden_layers": cfg["vision_config"]["num_hidden_layers"]}
    cfg["vision_config"]["num_hidden_layers"] = 7
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    assert encoder.load(str(tmp_path / "c"), device="cpu").config.depth == 2
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    cfg["vision_config"]["vision_use_head"] = False
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="vision_use_head"):
        encoder.load(str(tmp_path / "s"), device="cpu")
