"""Qwen3-VL / Qwen3.5 checkpoints whose config.json or preprocessor_config.json is spelled differently
from what `save_pretrained` writes, but as transformers reads it: our tower and preprocessing must be
transformers' (tiny float32 checkpoints, CPU)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import encoder
from tests.graph_cases import rel_err
from tests.hf_models import _qwen3_classes, hf_features, write_checkpoint
from tests.unit.encoder.models.test_qwen3_hf import random_pixels, run

GRID = [[1, 6, 10], [1, 4, 4]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, HF tower) of a tiny Qwen3-VL VLM as `save_pretrained` wrote it."""
    directory = tmp_path_factory.mktemp("qwen3_vl")
    return directory, write_checkpoint(directory, "qwen3_vl", "full", seed=11)


def edited_copy(saved, tmp_path, edit) -> str:
    directory = shutil.copytree(saved[0], tmp_path / "copy")
    cfg = json.loads((directory / "config.json").read_text())
    edit(cfg["vision_config"])
    (directory / "config.json").write_text(json.dumps(cfg))
    return str(directory)


def rename(old: str, new: str):
    return lambda vision: vision.update({new: vision.pop(old)})


@pytest.mark.parametrize(
    "edit",
    [rename("num_heads", "num_attention_heads"), rename("depth", "num_hidden_layers")],
    ids=["num_attention_heads", "num_hidden_layers"],
)
def test_attribute_map_names_are_read_as_transformers_reads_them(saved, tmp_path, edit):
    """HF's Qwen vision configs take `num_attention_heads` / `num_hidden_layers` for `num_heads` /
    `depth` (their `attribute_map`). Ignoring them ran 16 heads on a 4-head tower (silently other
    tokens) or built 27 blocks for a 3-block checkpoint (a 'missing weights' error)."""
    directory = edited_copy(saved, tmp_path, edit)
    hf_vision = _qwen3_classes("qwen3_vl")[0].from_pretrained(directory).vision_config
    assert (hf_vision.num_heads, hf_vision.depth) == (4, 3)
    enc = encoder.load(directory, device="cpu", dtype=torch.float32)
    pv = random_pixels(GRID, enc.config.patch_dim, seed=1)
    ref_tokens, ref_deep = hf_features(saved[1], pv, torch.tensor(GRID))
    out = run(enc.model, pv, GRID)
    assert rel_err(out.tokens, ref_tokens) <= 1e-5
    for ours, ref in zip(out.deepstack, ref_deep, strict=True):
        assert rel_err(ours, ref) <= 1e-5


def test_scalar_image_mean_and_std_are_per_channel_as_in_transformers():
    """transformers' image processors take one number for all three channels (`image_mean: 0.5`)."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from encoder.patchify import preprocess
    from encoder.preprocessing.qwen import PreprocessConfig

    raw = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": 0.25, "image_std": 0.5,
           "size": {"shortest_edge": 4096, "longest_edge": 65536}}  # fmt: skip
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 170, 3), dtype=np.uint8))
    ref = Qwen2VLImageProcessorPil(**raw)(images=[image], return_tensors="pt")
    ours = preprocess([image], PreprocessConfig.from_hf_dict(raw))
    assert torch.equal(ours.grid_thw, ref["image_grid_thw"])
    assert (ours.pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-5


def test_patch_embedding_in_another_layout_is_refused(saved, tmp_path):
    """The checkpoint's Conv3d kernel is [D, C, T, P, P]; a tensor of the same size in another layout
    (MLX's channels-last [D, T, P, P, C]) was reshaped into the linear layer without a word: every
    token wrong. transformers refuses it (size mismatch); so must we, naming the weight."""
    from safetensors.torch import load_file, save_file

    from encoder import CheckpointError

    directory = shutil.copytree(saved[0], tmp_path / "copy")
    state = load_file(directory / "model.safetensors")
    name = "model.visual.patch_embed.proj.weight"
    assert state[name].shape == (64, 3, 2, 16, 16)
    state[name] = state[name].permute(0, 2, 3, 4, 1).contiguous()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    match = r"'patch_embed.proj.weight' has shape \(64, 2, 16, 16, 3\), the config expects \(64, 3, 2, 16, 16\)"
    with pytest.raises(CheckpointError, match=match):
        encoder.load(str(directory), device="cpu")


def test_deepstack_indexes_out_of_order_come_in_block_order_as_in_transformers(saved, tmp_path):
    """`deepstack_visual_indexes` [2, 0]: merger k belongs to block indexes[k], and the features come in block
    order (block 0's first), as transformers emits them and its LLM adds them (feature k after decoder layer k)."""
    directory = edited_copy(saved, tmp_path, lambda vision: vision.update(deepstack_visual_indexes=[2, 0]))
    hf_tower = _qwen3_classes("qwen3_vl")[1].from_pretrained(directory).model.visual.eval()
    enc = encoder.load(directory, device="cpu", dtype=torch.float32)
    pv = random_pixels(GRID, enc.config.patch_dim, seed=2)
    ref_tokens, ref_deep = hf_features(hf_tower, pv, torch.tensor(GRID))
    out = run(enc.model, pv, GRID)
    _, sorted_deep = hf_features(saved[1], pv, torch.tensor(GRID))  # [0, 2]: other mergers on the same blocks
    assert len(out.deepstack) == len(ref_deep) == 2 and rel_err(ref_deep[0], sorted_deep[0]) > 1e-2
    assert rel_err(out.tokens, ref_tokens) <= 1e-5
    for ours, ref in zip(out.deepstack, ref_deep, strict=True):
        assert rel_err(ours, ref) <= 1e-5
