"""SigLIP2 NaFlex against Hugging Face transformers (float32, CPU): preprocessing equal to
`Siglip2ImageProcessorPil` (pixel rows and spatial shapes, the unpadded part), the packed tower equal to
`get_image_features` on several sizes and aspect ratios in one batch, checkpoints written by `save_pretrained`
(the full Siglip2Model and the vision model alone), preset sizes, and the graph runner (eager on CPU)
against the eager encoder on random mixes of grids.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

import encoder
from encoder import ConfigError, InvalidArgumentError
from encoder.config import Siglip2VisionConfig, from_hf_dict
from encoder.loading.presets import PRESETS, preset
from encoder.preprocessing.families import preprocess_config_from_dump
from encoder.preprocessing.naflex import NaflexPreprocessConfig, naflex_size
from tests.graph_cases import random_batch, rel_err

# a 8 x 8 position table resized to every grid; 100 patches at most per image (so grids differ from 8 x 8)
VISION = dict(hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, patch_size=16,
              num_patches=64)  # fmt: skip
TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
            max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
MAX_PATCHES = 100
# (height, width): extreme aspect ratios both ways, a 1x1 image upscaled, odd sizes, one at the patch grid
SIZES = [(16, 1024), (1024, 16), (1, 1), (37, 91), (200, 150), (160, 160), (5, 300)]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (p.dim() == 1))


def hf_processor(**kwargs):
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    return Siglip2ImageProcessorPil(**kwargs)


def images(sizes, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.fixture(scope="module", params=["full", "vision"])
def checkpoint(request, tmp_path_factory):
    """(directory, HF vision model, HF processor) of a tiny checkpoint saved by transformers."""
    import transformers as tf

    directory = tmp_path_factory.mktemp(f"siglip2-{request.param}")
    if request.param == "full":
        model = tf.Siglip2Model(tf.Siglip2Config(vision_config=VISION, text_config=TEXT))
    else:
        model = tf.Siglip2VisionModel(tf.Siglip2VisionConfig(**VISION))
    _randomize(model, seed=len(request.param))
    model.eval().save_pretrained(directory)
    processor = hf_processor(patch_size=16, max_num_patches=MAX_PATCHES)
    processor.save_pretrained(directory)
    tower = model.vision_model if request.param == "full" else model
    return directory, tower, processor


def test_preprocessing_equals_hf_processor(checkpoint):
    directory, _, processor = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    pp = enc.preprocess_config
    assert isinstance(pp, NaflexPreprocessConfig) and pp.max_num_patches == MAX_PATCHES
    assert preprocess_config_from_dump(pp.model_dump()) == pp
    imgs = images(SIZES)
    batch = enc.preprocess(imgs)
    hf = processor(images=imgs, return_tensors="pt")
    start = 0
    for i, (t, h, w) in enumerate(batch.grid_thw.tolist()):
        n = h * w
        assert t == 1 and tuple(hf["spatial_shapes"][i].tolist()) == (h, w)
        assert int(hf["pixel_attention_mask"][i].sum()) == n == enc.num_patches(*SIZES[i]) <= MAX_PATCHES
        assert torch.equal(batch.pixel_values[start : start + n], hf["pixel_values"][i, :n])
        start += n
    assert start == batch.pixel_values.shape[0]  # packed: no padding rows


def test_features_equal_hf_in_one_packed_batch(checkpoint):
    directory, tower, processor = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    assert enc.config.family == "siglip2" and enc.default_pooling == "model"
    imgs = images(SIZES, seed=1)
    batch = enc.preprocess(imgs)
    with torch.no_grad():
        ref = tower(**processor(images=imgs, return_tensors="pt"))
    model, tokens, means = enc.encode(batch), enc.encode(batch, "none"), enc.encode(batch, "mean")
    normed, mean_l2 = enc.encode(batch, "model-l2"), enc.encode(batch, "mean-l2")
    for i in range(len(imgs)):
        n = tokens[i].shape[0]
        want = ref.last_hidden_state[i, :n]
        assert model[i].shape == (enc.output_dim("model"),)
        assert rel_err(model[i], ref.pooler_output[i]) <= 1e-5
        assert rel_err(tokens[i], want) <= 1e-5
        assert rel_err(means[i], want.mean(0)) <= 1e-5
        assert rel_err(normed[i], torch.nn.functional.normalize(ref.pooler_output[i], dim=-1)) <= 1e-5
        assert rel_err(mean_l2[i], torch.nn.functional.normalize(want.mean(0), dim=-1)) <= 1e-5
    # one image alone gives what it gave in the pack
    alone = enc.encode(enc.preprocess(imgs[3:4]))
    assert rel_err(alone[0], model[3]) <= 1e-6


def test_get_image_features_of_the_full_model(tmp_path):
    import transformers as tf

    model = tf.Siglip2Model(tf.Siglip2Config(vision_config=VISION, text_config=TEXT))
    _randomize(model, seed=7)
    model.eval().save_pretrained(tmp_path)
    processor = hf_processor(patch_size=16, max_num_patches=MAX_PATCHES)
    processor.save_pretrained(tmp_path)
    enc = encoder.load(str(tmp_path), device="cpu", dtype=torch.float32)
    imgs = images([(16, 1024), (1, 1), (300, 200)], seed=2)
    with torch.no_grad():
        ref = model.get_image_features(**processor(images=imgs, return_tensors="pt")).pooler_output
    for ours, want in zip(enc.encode(imgs), ref, strict=True):
        assert rel_err(ours, want) <= 1e-5


def test_naflex_size_rule():
    # transformers' function, the same numbers
    from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches

    rng = random.Random(0)
    for _ in range(200):
        h, w, p, n = rng.randint(1, 3000), rng.randint(1, 3000), rng.choice([14, 16]), rng.choice([64, 256, 1024])
        assert naflex_size(h, w, p, n) == get_image_size_for_max_num_patches(h, w, p, n)


def test_config_and_processor_checks():
    cfg = from_hf_dict({"model_type": "siglip2", **VISION}, model_type="siglip2")
    assert isinstance(cfg, Siglip2VisionConfig) and cfg.position_grid == 8
    assert from_hf_dict({"model_type": "siglip2_vision_model", **VISION}) == cfg
    with pytest.raises(ConfigError, match="square"):
        from_hf_dict({**VISION, "num_patches": 60}, model_type="siglip2")
    with pytest.raises(ConfigError, match="patch size"):
        NaflexPreprocessConfig.from_hf_dict({"patch_size": 14}, cfg)
    with pytest.raises(ConfigError, match="do_normalize"):
        NaflexPreprocessConfig.from_hf_dict({"do_normalize": False}, cfg)
    pp = NaflexPreprocessConfig.from_hf_dict({}, cfg)
    assert (pp.patch_size, pp.max_num_patches, pp.resample) == (16, 256, 2)


def test_model_pooling_and_still_images_only():
    enc = encoder.load("tiny-siglip2", device="cpu")
    assert enc.resolve_pooling("model-l2") == "model-l2"
    batch = random_batch([[2, 2, 3]], enc.config.patch_dim, seed=0)
    with pytest.raises(InvalidArgumentError, match="still images"):
        enc.encode(batch)


@pytest.mark.parametrize("name", [n for n, c in PRESETS.items() if isinstance(c, Siglip2VisionConfig)])
def test_preset_parameter_counts_equal_transformers(name):
    import transformers as tf

    cfg = preset(name)
    hf_cfg = tf.Siglip2VisionConfig(**cfg.model_dump(exclude={"family"}))
    with torch.device("meta"):
        theirs = sum(p.numel() for p in tf.Siglip2VisionModel(hf_cfg).parameters())
        ours = sum(p.numel() for p in encoder.api.build_tower(cfg, None).parameters())
    assert ours == theirs


@torch.no_grad()
def test_graph_encoder_equals_eager_on_random_grids():
    import workspace

    enc = encoder.load("tiny-siglip2", device="cpu")
    graph = workspace.GraphEncoder(enc, buckets="64,256")
    rng = random.Random(0)
    for case in range(6):
        # within the preset's max_num_patches (64), so every pack replays; one image past it runs eagerly
        grids = [[1, rng.randint(1, 16), rng.randint(1, 16)] for _ in range(rng.randint(1, 12))]
        grids = [[1, h, min(w, 64 // h)] for _, h, w in grids] + ([[1, 9, 9]] if case == 5 else [])
        batch = random_batch(grids, enc.config.patch_dim, seed=case)
        for pooling in ("model", "mean", "none"):
            got, want = graph.encode(batch, pooling), enc.encode(batch, pooling)
            assert len(got) == len(want)
            for g, e in zip(got, want, strict=True):
                assert g.shape == e.shape and rel_err(g, e) <= 1e-5
    stats = graph.runner.stats
    assert stats.eager_runs == 3 and sum(stats.replays.values()) >= 18


def test_service_patchify_equals_preprocess():
    """The replica's path (uint8 arrays stacked by width, patchified at once) gives the same rows."""
    from encoder.patchify import preprocess, stack_patchify

    pp = NaflexPreprocessConfig(patch_size=16, max_num_patches=MAX_PATCHES)
    imgs = images([(100, 100), (100, 100), (16, 1024), (90, 200)], seed=3)
    arrays = [pp.resize(img) for img in imgs]
    want = preprocess(imgs, pp)
    got = stack_patchify(arrays, pp, torch.device("cpu"))
    assert torch.equal(got.grid_thw, want.grid_thw) and torch.equal(got.pixel_values, want.pixel_values)


def test_pooling_head_ignores_nan_in_padding_rows():
    """Rows past the last image (bucket padding) hold what no kernel wrote — NaN on the GPU seen without FA4 —
    and the head's one-hot GEMMs multiply them by 0: the pooled vectors stay those of the real rows alone."""
    from encoder.models.vit import packed_slots

    enc = encoder.load("tiny-siglip2", device="cpu", dtype=torch.float32)
    head = enc.model.head
    frames_hw = torch.tensor([[2, 3], [4, 1], [0, 0]])  # two images, an empty slot
    real = 2 * 3 + 4 * 1
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(real + 5, enc.config.width, generator=gen)  # 5 padding rows
    slot, _, _ = packed_slots(frames_hw, tokens.shape[0])
    with torch.inference_mode():
        clean = head(tokens, slot, 3)
        poisoned = tokens.clone()
        poisoned[real:] = float("nan")
        poisoned[real + 1] = float("inf")
        got = head(poisoned, slot, 3)
        alone = head(tokens[:real], slot[:real], 3)  # no padding rows at all
    assert torch.isfinite(got).all() and torch.equal(got, clean)
    torch.testing.assert_close(got, alone, rtol=1e-6, atol=1e-6)
