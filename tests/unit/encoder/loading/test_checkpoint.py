"""Checkpoint loading: layouts and every way a directory can be wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import encoder
from encoder import CheckpointError, ConfigError
from tests.hf_models import write_checkpoint
from tests.images_util import random_image


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    directory = tmp_path_factory.mktemp("good")
    write_checkpoint(directory, "qwen2_5_vl", "full", processor={"min_pixels": 3136, "max_pixels": 200704})
    return directory


def copy_dir(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_preprocessor_config_is_read(good):
    enc = encoder.load(str(good), device="cpu")
    assert enc.preprocess_config.max_pixels == 200704
    assert enc.config.family == "qwen2_5_vl"


def test_processor_config_json_is_read_first_as_transformers_reads_it(good, tmp_path):
    """transformers 5's `processor.save_pretrained` writes the image processor's settings into
    processor_config.json (under "image_processor") and AutoImageProcessor reads them there before
    preprocessor_config.json: a fine-tuned checkpoint saved that way must preprocess as HF does."""
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    d = copy_dir(good, tmp_path / "d")  # its preprocessor_config.json says max_pixels 200704
    published = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056).to_dict()  # Qwen2.5-VL's Hub values
    (d / "processor_config.json").write_text(json.dumps({"image_processor": published, "processor_class": "x"}))
    # which file transformers reads (its processor class depends on what is installed: torchvision's resizes
    # differently, so the pixels are compared with the PIL processor of the settings it read)
    read = AutoImageProcessor.from_pretrained(d).size
    assert (read["shortest_edge"], read["longest_edge"]) == (3136, 12845056)
    image = random_image("RGB", 1400, 1000, seed=2)  # over 200,704 pixels, under 12,845,056
    hf = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)(image, return_tensors="pt")
    ours = encoder.load(str(d), device="cpu").preprocess([image])
    assert ours.grid_thw.tolist() == hf["image_grid_thw"].tolist() == [[1, 100, 72]]
    torch.testing.assert_close(ours.pixel_values, hf["pixel_values"], rtol=0, atol=1e-5)
    # without an "image_processor" entry the file is not the image processor's: preprocessor_config.json is
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "x"}))
    assert encoder.load(str(d), device="cpu").preprocess_config.max_pixels == 200704


def test_image_processor_that_does_not_fit_the_model_fails_at_load_naming_the_file(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    (d / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "merge_size": 2}))
    with pytest.raises(ConfigError, match=r"preprocessor_config.json: .*patch_size 16 \(the model's is 14\)"):
        encoder.load(str(d), device="cpu")
    (d / "preprocessor_config.json").unlink()
    (d / "processor_config.json").write_text(json.dumps({"image_processor": {"image_std": [0, 0, 0]}}))
    with pytest.raises(ConfigError, match=r"processor_config.json: invalid preprocessor config"):
        encoder.load(str(d), device="cpu")


def test_unknown_model_type(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llava"
    cfg["vision_config"]["model_type"] = "clip_vision_model"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown model_type.*llava"):
        encoder.load(str(d), device="cpu")


def test_invalid_config_json(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        encoder.load(str(d), device="cpu")


def test_missing_config(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        encoder.load(str(d), device="cpu")


def test_corrupt_safetensors(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        encoder.load(str(d), device="cpu")


def test_garbage_safetensors(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        encoder.load(str(d), device="cpu")


def test_missing_shard(tmp_path):
    d = tmp_path / "sharded"
    write_checkpoint(d, "qwen2_vl", "vision-sharded")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"missing: .*{shards[1].name}"):
        encoder.load(str(d), device="cpu")


@pytest.mark.parametrize("shard", [None, 3, ["model-00001-of-00002.safetensors"]])
def test_index_with_a_shard_name_that_is_not_a_string(tmp_path, shard):
    d = tmp_path / "sharded"
    write_checkpoint(d, "qwen2_vl", "vision-sharded")
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: 'weight_map' must map tensor names to "):
        encoder.load(str(d), device="cpu")


def test_missing_weight(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    state = load_file(d / "model.safetensors")
    del state["visual.blocks.1.attn.qkv.bias"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing vision weights \(1\): blocks.1.attn.qkv.bias"):
        encoder.load(str(d), device="cpu")


def test_unexpected_weight(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    state = load_file(d / "model.safetensors")
    state["visual.blocks.0.attn.extra.weight"] = torch.ones(3)
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected vision weights.*blocks.0.attn.extra.weight"):
        encoder.load(str(d), device="cpu")


def test_wrong_shape(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    state = load_file(d / "model.safetensors")
    state["visual.merger.mlp.2.weight"] = torch.ones(7, 256)
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'merger.mlp.2.weight' has shape \(7, 256\)"):
        encoder.load(str(d), device="cpu")


def test_pickled_weights_refused(good, tmp_path):
    d = copy_dir(good, tmp_path / "d")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="only pickled weights.*safetensors are required"):
        encoder.load(str(d), device="cpu")


def test_unknown_preset_and_dtype():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny"):
        encoder.load("nope", device="cpu")
    with pytest.raises(ConfigError, match="unknown dtype"):
        encoder.load("tiny", device="cpu", dtype="int8")


def test_unknown_attention_backend():
    with pytest.raises(encoder.BackendUnavailableError, match="unknown attention backend 'nope'.*sdpa"):
        encoder.load("tiny", device="cpu", attention="nope")
