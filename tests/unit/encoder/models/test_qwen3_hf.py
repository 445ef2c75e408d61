"""The Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 tower against Hugging Face transformers (float32, CPU).

Checkpoints are tiny random ones that transformers itself wrote (`hf_models`); the real presets are
checked against transformers' own vision models built from the same config on the meta device.
Published vision_config values behind the real presets (all: patch 16, temporal 2, merge 2, heads 16
unless noted, num_position_embeddings 2304, gelu_pytorch_tanh):
  * Qwen3-VL-2B / 4B: depth 24, hidden 1024, intermediate 4096, out 2048 / 2560, DeepStack [5, 11, 17]
    (Qwen3-VL-4B-Instruct config.json, transformers 4.57, as quoted in public repositories; 2B as in
    sgl-jax's Qwen3VLVisionConfig defaults);
  * Qwen3-VL-8B / 32B / 30B-A3B / 235B-A22B: depth 27, hidden 1152, intermediate 4304, DeepStack
    [8, 16, 24], out 4096 / 5120 / 2048 / 4096 (8B: its config.json and ollama's GGUF metadata; the
    others: out_hidden_size is the LLM's hidden size, that of Qwen3-32B / Qwen3-30B-A3B / Qwen3-235B-A22B);
  * Qwen3.5-0.8B: depth 12, hidden 768, intermediate 3072, heads 12, out 1024; Qwen3.5-9B / 27B /
    35B-A3B: depth 27, hidden 1152, intermediate 4304, out 4096 / 5120 / 2048; `deepstack_visual_indexes`
    is [] (Qwen/Qwen3.5-27B config.json as quoted in GPTQModel's issue tracker; 35B-A3B's in
    public test fixtures).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import encoder
from encoder import CheckpointError
from encoder.config import Qwen3VLVisionConfig, from_hf_dict
from encoder.loading.presets import PRESETS
from encoder.models.geometry import frames_of
from tests.graph_cases import rel_err
from tests.hf_models import (
    QWEN3_FAMILIES,
    _qwen3_classes,
    check_norms_on_small_activations,
    full_model,
    hf_features,
    write_checkpoint,
)

# (t, h, w) in patches: smaller and larger than the 8 x 8 position grid, non-square both ways, the
# minimum, and a two-frame clip (each frame its own segment, the position table repeated per frame)
GRIDS = [[1, 8, 8], [1, 4, 12], [1, 18, 6], [1, 2, 2], [1, 10, 14], [2, 6, 4]]
# every family as a full VLM; the tower saved alone (sharded) for one DeepStack and one plain family
FULL = [(f, "full") for f in QWEN3_FAMILIES]
CASES = [*FULL, ("qwen3_vl", "vision-sharded"), ("qwen3_5", "vision-sharded")]


def random_pixels(grid: list[list[int]], patch_dim: int, seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grid)
    return torch.randn(n, patch_dim, generator=torch.Generator().manual_seed(seed))


def run(model, pixel_values: torch.Tensor, grid: list[list[int]], frames: torch.Tensor | None = None, bounds=None):
    frames = frames_of(torch.tensor(grid)) if frames is None else frames
    with torch.inference_mode():
        return model.forward_packed(pixel_values, frames, bounds or model.batch_bounds(grid))


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    """(family, layout, directory, HF tower) of a tiny checkpoint, written once per module; tests
    choose cases by indirect parametrisation and copy the directory before changing it."""
    family, layout = request.param
    directory = tmp_path_factory.mktemp(f"{family}-{layout}")
    tower = write_checkpoint(directory, family, layout, seed=7)
    return family, layout, directory, tower


def cases(*which):
    return pytest.mark.parametrize("checkpoint", which, indirect=True, ids="-".join)


@cases(*CASES)
def test_tokens_and_deepstack_match_hf(checkpoint):
    family, _, directory, tower = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    assert enc.config.deepstack_visual_indexes == (() if family.startswith("qwen3_5") else (0, 2))
    pv = random_pixels(GRIDS, enc.config.patch_dim, seed=1)
    ref_tokens, ref_deep = hf_features(tower, pv, torch.tensor(GRIDS))
    out = run(enc.model, pv, GRIDS)
    assert out.tokens.shape == ref_tokens.shape == (pv.shape[0] // 4, enc.out_dim)
    assert rel_err(out.tokens, ref_tokens) <= 1e-5
    assert len(out.deepstack) == len(ref_deep) == len(enc.config.deepstack_visual_indexes)
    for ours, ref in zip(out.deepstack, ref_deep, strict=True):
        assert rel_err(ours, ref) <= 1e-5
    # per-frame means: the clip's two frames are two slots
    counts = [h * w // 4 for t, h, w in GRIDS for _ in range(t)]
    ref_means = torch.stack([part.mean(0) for part in torch.split(ref_tokens, counts)])
    assert rel_err(out.means, ref_means) <= 1e-5


@cases(*FULL)
def test_encode_llm_matches_get_image_features(checkpoint):
    """Per image through `VisionEncoder.encode_llm` against the full VLM's `get_image_features`."""
    family, _, directory, _ = checkpoint
    hf = _qwen3_classes(family)[1].from_pretrained(directory, dtype=torch.float32).eval()
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    grid = torch.tensor(GRIDS[:4])
    pv = random_pixels(GRIDS[:4], enc.config.patch_dim, seed=2)
    with torch.no_grad():
        ref = hf.get_image_features(pv, image_grid_thw=grid)
    outs = enc.encode_llm(encoder.PatchBatch(pv, grid))
    counts = [int(n) // 4 for n in grid.prod(1)]
    deep = [
        f if isinstance(f, list | tuple) else torch.split(f, counts)
        for f in getattr(ref, "deepstack_features", None) or []
    ]
    for i, out in enumerate(outs):
        assert tuple(out.grid_thw) == tuple(GRIDS[i])
        assert rel_err(out.tokens, ref.pooler_output[i]) <= 1e-5
        assert len(out.deepstack) == len(deep)
        for ours, layer in zip(out.deepstack, deep, strict=True):
            assert rel_err(ours, layer[i]) <= 1e-5


@cases(("qwen3_vl", "full"), ("qwen3_5", "full"))
def test_norms_match_hf_on_small_activations(checkpoint):
    """Every LayerNorm (blocks, merger, DeepStack mergers over mu * D) where eps is a visible share of the
    variance (`check_norms_on_small_activations`)."""
    _, _, directory, tower = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    norms = 2 * enc.config.depth + 1 + len(enc.config.deepstack_visual_indexes)
    assert check_norms_on_small_activations(tower, enc.model) == norms


@cases(("qwen3_vl", "full"), ("qwen3_5", "vision-sharded"))
def test_each_image_alone_equals_packed(checkpoint):
    """Packing must not leak attention or positions across images."""
    _, _, directory, _ = checkpoint
    model = encoder.load(str(directory), device="cpu", dtype=torch.float32).model
    grid = GRIDS[:3]
    pv = random_pixels(grid, model.patch_dim, seed=3)
    packed = run(model, pv, grid)
    start = 0
    for g in grid:
        n = g[0] * g[1] * g[2]
        alone = run(model, pv[start : start + n], [g])
        rows = slice(start // 4, (start + n) // 4)
        assert rel_err(alone.tokens, packed.tokens[rows]) <= 1e-5
        for a, p in zip(alone.deepstack, packed.deepstack, strict=True):
            assert rel_err(a, p[rows]) <= 1e-5
        start += n


@cases(("qwen3_vl", "full"), ("qwen3_5", "full"))
def test_padded_geometry_keeps_real_rows(checkpoint):
    """Graph-mode geometry: padding rows with large random pixels, an empty slot between real frames
    and empty slots after them, max_seqlen at its bound. No real row changes, nothing is NaN/Inf."""
    model = encoder.load(str(checkpoint[2]), device="cpu", dtype=torch.float32).model
    grid = [[1, 6, 10], [1, 4, 4], [1, 12, 8]]
    pv = random_pixels(grid, model.patch_dim, seed=4)
    eager = run(model, pv, grid)
    real, total = pv.shape[0], pv.shape[0] + 40
    zero = torch.zeros(1, 2, dtype=torch.long)
    frames = frames_of(torch.tensor(grid))
    frames = torch.cat([frames[:1], zero, frames[1:], zero.repeat(4, 1)])
    padded = torch.cat([pv, torch.randn(total - real, model.patch_dim) * 100])
    out = run(model, padded, grid, frames=frames, bounds=model.bucket_bounds(total, 8, total))
    assert all(torch.isfinite(t).all() for t in out.tensors())
    assert rel_err(out.tokens[: real // 4], eager.tokens) <= 1e-6
    for ours, ref in zip(out.deepstack, eager.deepstack, strict=True):
        assert rel_err(ours[: real // 4], ref) <= 1e-6
    assert rel_err(out.means[[0, 2, 3]], eager.means) <= 1e-6
    assert not out.means[[1, 4, 5, 6, 7]].any()


def test_fuse_pads_the_mlp_exactly():
    enc = encoder.load("tiny-qwen3-vl", device="cpu")
    grid = [[1, 8, 12], [1, 6, 6]]
    pv = random_pixels(grid, enc.config.patch_dim, seed=5)
    before = run(enc.model, pv, grid)
    enc.model.fuse(128)
    mlps = [blk.mlp for blk in enc.model.blocks]
    assert {m.linear_fc1.out_features for m in mlps} == {128}
    after = run(enc.model, pv, grid)
    for a, b in zip(before.tensors(), after.tensors(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    enc.model.fuse(128)  # idempotent: the same modules stay
    assert all(blk.mlp is m for blk, m in zip(enc.model.blocks, mlps, strict=True))
    with torch.device("meta"):
        big = encoder.api.build_tower(PRESETS["qwen3-vl-8b"], enc.model.backend)
    big.fuse()
    assert big.blocks[0].mlp.linear_fc1.weight.shape == (4352, 1152)


REAL_PRESETS = [n for n, c in PRESETS.items() if isinstance(c, Qwen3VLVisionConfig) and not n.startswith("tiny")]


@pytest.mark.parametrize("name", REAL_PRESETS)
def test_real_preset_parameter_counts_match_hf(name):
    cfg = PRESETS[name]
    family = ("qwen3_5" if name.startswith("qwen3.5") else "qwen3_vl") + ("_moe" if "-a" in name else "")
    _, _, vision_cfg, vision_cls = _qwen3_classes(family)
    fields = dict(
        depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads, out_hidden_size=cfg.out_hidden_size, patch_size=cfg.patch_size,
        num_position_embeddings=cfg.num_position_embeddings,
    )  # fmt: skip
    if not family.startswith("qwen3_5"):
        fields["deepstack_visual_indexes"] = list(cfg.deepstack_visual_indexes)
    with torch.device("meta"):
        hf = vision_cls(vision_cfg(**fields))
        ours = encoder.api.build_tower(cfg, None)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    hf_names = {k: v.shape for k, v in hf.state_dict().items()}
    ours_names = {k: v.shape for k, v in ours.state_dict().items()}
    assert ours_names.keys() == hf_names.keys()


def test_published_config_dicts_map_to_the_presets():
    # vision_config as published (model_type of the VLM inside it, as checkpoints written by
    # transformers 4.57 have it)
    qwen3_vl_8b = dict(
        deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh", hidden_size=1152,
        in_channels=3, initializer_range=0.02, intermediate_size=4304, model_type="qwen3_vl", num_heads=16,
        num_position_embeddings=2304, out_hidden_size=4096, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2,
    )  # fmt: skip
    assert from_hf_dict(qwen3_vl_8b, model_type="qwen3_vl") == PRESETS["qwen3-vl-8b"]
    qwen35_27b = dict(qwen3_vl_8b, deepstack_visual_indexes=[], model_type="qwen3_5", out_hidden_size=5120)
    assert from_hf_dict(qwen35_27b, model_type="qwen3_5") == PRESETS["qwen3.5-27b"]
    # Qwen3.5 never has DeepStack mergers (HF ignores the field); Qwen3-VL without the field has HF's default
    assert from_hf_dict({**qwen35_27b, "deepstack_visual_indexes": [3]}, "qwen3_5").deepstack_visual_indexes == ()
    alone = {k: v for k, v in qwen3_vl_8b.items() if k != "deepstack_visual_indexes"}
    assert from_hf_dict({**alone, "model_type": "qwen3_vl_moe_vision"}).deepstack_visual_indexes == (8, 16, 24)


def copy_checkpoint(checkpoint, tmp_path):
    return shutil.copytree(checkpoint[2], tmp_path / "copy")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop("model.visual.deepstack_merger_list.1.norm.bias"),
         r"missing vision weights \(1\): deepstack_merger_list.1.norm.bias"),
        (lambda s: s.update({"model.visual.deepstack_merger_list.2.norm.bias": torch.ones(256)}),
         "unexpected vision weights.*deepstack_merger_list.2.norm.bias"),
        (lambda s: s.update({"model.visual.pos_embed.weight": torch.ones(81, 64)}),
         r"'pos_embed.weight' has shape \(81, 64\), the config expects \(64, 64\)"),
        (lambda s: [s.pop(k) for k in list(s) if k.startswith("model.visual.")],
         "no vision tower weights found"),
    ],
    ids=["missing", "unexpected", "shape", "no-tower"],
)  # fmt: skip
@cases(("qwen3_vl", "full"))
def test_checkpoint_weight_errors(checkpoint, edit, match, tmp_path):
    directory = copy_checkpoint(checkpoint, tmp_path)
    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        encoder.load(str(directory), device="cpu")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"deepstack_visual_indexes": [0, 3]}, r"(?s)invalid vision config.*deepstack_visual_indexes \[3\] outside"),
        ({"num_position_embeddings": 60}, "(?s)invalid vision config.*not a square grid"),
        ({"hidden_act": "relu"}, "(?s)invalid vision config.*hidden_act"),
        ({"rope_parameters": "axial"}, "(?s)invalid vision config.*rope_parameters must be a JSON object"),
    ],
)
@cases(("qwen3_vl", "full"))
def test_checkpoint_config_errors(checkpoint, change, match, tmp_path):
    directory = copy_checkpoint(checkpoint, tmp_path)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["vision_config"].update(change)
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        encoder.load(str(directory), device="cpu")


def test_random_preset_is_deterministic_and_full_model_builds():
    a, b = encoder.load("tiny-qwen3-vl", device="cpu"), encoder.load("tiny-qwen3-vl", device="cpu")
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # the builders other tests use for LLM logits: image tokens inside the tiny vocabulary
    model = full_model("qwen3_vl", seed=3)
    assert model.config.image_token_id < model.config.text_config.vocab_size


def qwen3_processor():
    """HF's processor as Qwen3-VL / Qwen3.5 checkpoints configure it (their preprocessor_config.json)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    )  # fmt: skip


@cases(("qwen3_vl", "full"))
def test_images_end_to_end_match_hf_processor_and_model(checkpoint, tmp_path):
    """Mixed input kinds, sizes and aspect ratios through our preprocessing (from the
    preprocessor_config.json HF's processor saved) and tower, against HF's processor and tower."""
    import io

    import numpy as np
    from PIL import Image

    from tests.images_util import encode as encode_image
    from tests.images_util import random_image

    directory = copy_checkpoint(checkpoint, tmp_path)
    proc = qwen3_processor()
    proc.save_pretrained(directory)
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    # no preprocessor_config.json: the same settings by default
    assert encoder.api.preprocess_config_for(enc.config, None) == enc.preprocess_config
    pil = [
        random_image("RGB", 90, 140, seed=1),  # upscaled to the 256 x 256 minimum area
        random_image("RGB", 300, 200, seed=2),  # tall
        random_image("L", 64, 700, seed=3),  # grayscale, very wide
        random_image("RGBA", 40, 40, seed=4),  # tiny and square, with alpha
    ]
    inputs = [encode_image(pil[0], "PNG"), encode_image(pil[1], "JPEG"), pil[2], np.asarray(pil[3].convert("RGB"))]
    hf_images = [pil[0], Image.open(io.BytesIO(inputs[1])).convert("RGB"), pil[2].convert("RGB"), pil[3].convert("RGB")]
    hf_in = proc(images=hf_images, return_tensors="pt")
    ours = enc.preprocess(inputs)
    assert torch.equal(ours.grid_thw, hf_in["image_grid_thw"])
    assert len(set(map(tuple, ours.grid_thw.tolist()))) == 4  # four different grids
    assert (ours.pixel_values - hf_in["pixel_values"]).abs().max().item() <= 1e-5
    ref_tokens, ref_deep = hf_features(checkpoint[3], hf_in["pixel_values"], hf_in["image_grid_thw"])
    counts = [int(n) // 4 for n in hf_in["image_grid_thw"].prod(1)]
    for i, out in enumerate(enc.encode_llm(inputs)):
        assert rel_err(out.tokens, torch.split(ref_tokens, counts)[i]) <= 1e-5
        for ours_k, ref_k in zip(out.deepstack, ref_deep, strict=True):
            assert rel_err(ours_k, torch.split(ref_k, counts)[i]) <= 1e-5
