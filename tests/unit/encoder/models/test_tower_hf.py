"""The towers against Hugging Face transformers on checkpoints it wrote (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

import encoder
from encoder.models.geometry import count_windows, frames_of
from tests.hf_models import check_norms_on_small_activations, hf_tokens, write_checkpoint

FAMILIES = ["qwen2_5_vl", "qwen2_vl"]
LAYOUTS = ["full", "full-sharded", "vision-sharded"]
# (t, h, w) in patches: square, wide, tall, the minimum, windows that do not divide the grid
GRIDS = [[1, 8, 8], [1, 4, 12], [1, 18, 6], [1, 2, 2], [1, 20, 22], [1, 10, 26]]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=[(f, lay) for f in FAMILIES for lay in LAYOUTS], ids=lambda p: "-".join(p))
def checkpoint(request, tmp_path_factory):
    family, layout = request.param
    directory = tmp_path_factory.mktemp(f"{family}-{layout}")
    tower = write_checkpoint(directory, family, layout, seed=hash(layout) % 1000)
    return directory, tower


def test_packed_tokens_match_hf(checkpoint):
    directory, tower = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    grid = torch.tensor(GRIDS)
    gen = torch.Generator().manual_seed(1)
    pv = torch.randn(int(grid.prod(1).sum()), enc.config.patch_dim, generator=gen)
    ref = hf_tokens(tower, pv, grid)
    outs = enc.encode(encoder.PatchBatch(pv, grid), pooling="none")
    counts = [t * h * w // 4 for t, h, w in GRIDS]
    for out, ref_i, n in zip(outs, torch.split(ref, counts), counts, strict=True):
        assert out.shape == (n, enc.out_dim)
        assert rel_err(out, ref_i) <= 1e-5
    means = enc.encode(encoder.PatchBatch(pv, grid), pooling="mean")
    for mean, ref_i in zip(means, torch.split(ref, counts), strict=True):
        assert mean.shape == (enc.out_dim,)
        assert rel_err(mean, ref_i.mean(0)) <= 1e-5


def test_each_image_alone_equals_packed(checkpoint):
    """Packing must not leak attention across images: alone and packed give the same tokens."""
    directory, _ = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    grid = torch.tensor(GRIDS[:3])
    pv = torch.randn(int(grid.prod(1).sum()), enc.config.patch_dim, generator=torch.Generator().manual_seed(2))
    batch = encoder.PatchBatch(pv, grid)
    packed = enc.encode(batch)
    for i in range(len(GRIDS[:3])):
        alone = enc.encode(batch.split([i]))[0]
        assert rel_err(alone, packed[i]) <= 1e-5


def test_norms_match_hf_on_small_activations(checkpoint):
    """Every norm (blocks, merger) where eps is a visible share of the variance (`check_norms_on_small_activations`)."""
    directory, tower = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    assert check_norms_on_small_activations(tower, enc.model) == 2 * enc.config.depth + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_geometry_keeps_real_rows(family, tmp_path):
    """Graph-mode geometry (padding tokens, empty frames, window slots at their bound) changes no
    real output row and yields no NaN/Inf."""
    directory = tmp_path / "ckpt"
    write_checkpoint(directory, family, "full")
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    cfg = enc.config
    grid = torch.tensor([[1, 6, 10], [1, 4, 4], [1, 12, 8]])
    real = int(grid.prod(1).sum())
    pv = torch.randn(real, cfg.patch_dim, generator=torch.Generator().manual_seed(3))
    eager = enc.forward_packed(encoder.PatchBatch(pv, grid))
    total = real + 40  # bucket padding, a multiple of the merge unit
    frames = torch.cat([frames_of(grid), torch.zeros(5, 2, dtype=torch.long)])
    bounds = enc.model.bucket_bounds(total, frames.shape[0], total)
    padded_pv = torch.cat([pv, torch.randn(total - real, cfg.patch_dim) * 100])
    with torch.inference_mode():
        out = enc.model.forward_packed(padded_pv, frames, bounds).tokens
    assert torch.isfinite(out).all()
    assert rel_err(out[: real // 4], eager) <= 1e-6
    assert count_windows(grid.tolist(), cfg) <= total // cfg.merge_unit


@pytest.mark.parametrize(("name", "params"), [("qwen2.5-vl-7b", 676_550_144), ("qwen2-vl-2b", 665_271_296)])
def test_real_size_parameter_counts(name, params):
    # the tower encoder.load builds, on the meta device as load does first: counting needs no weights (their
    # seeded init of ~670M parameters took 20 s of CPU)
    from encoder.api import build_tower
    from encoder.loading.presets import preset

    with torch.device("meta"):
        tower = build_tower(preset(name), None)
    assert sum(p.numel() for p in tower.parameters()) == params


def test_random_presets_are_deterministic():
    a = encoder.load("tiny", device="cpu")
    b = encoder.load("tiny", device="cpu")
    for (na, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2-vl"])
def test_mlp_width_padding_is_exact(name):
    from tests.graph_cases import random_batch

    enc = encoder.load(name, device="cpu")
    batch = random_batch([[1, 8, 12], [1, 6, 6]], enc.config.patch_dim, seed=0)
    before = enc.encode(batch)
    old = enc.model.blocks[0].mlp
    enc.model.fuse(256)
    mlp = enc.model.blocks[0].mlp
    assert mlp is not old and next(iter(old.state_dict().values())).shape[0] == enc.config.mlp_dim  # a new module
    assert next(iter(mlp.state_dict().values())).shape[0] in (256, 512)  # padded (SwiGLU: gate | up)
    after = enc.encode(batch)
    assert all((a - b).abs().max() <= 1e-6 for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_images_end_to_end_match_hf_processor_and_model(family, tmp_path):
    """Mixed input kinds and sizes through our preprocess + tower against the HF image processor +
    HF tower on the same checkpoint (float32, CPU)."""
    import io

    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.images_util import encode as encode_image
    from tests.images_util import random_image

    directory = tmp_path / "ckpt"
    tower = write_checkpoint(directory, family, "full", processor={"min_pixels": 3136, "max_pixels": 401408})
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    pil = [
        random_image("RGB", 90, 140, seed=1),
        random_image("RGB", 300, 200, seed=2),
        random_image("L", 64, 500, seed=3),
        random_image("RGBA", 33, 47, seed=4),
    ]
    inputs = [
        encode_image(pil[0], "PNG"),  # bytes: PNG
        encode_image(pil[1], "JPEG"),  # bytes: JPEG
        pil[2],  # PIL, grayscale, wide
        np.asarray(pil[3].convert("RGB")),  # uint8 HWC array, tiny (upscaled to min_pixels)
    ]
    hf_images = [
        pil[0],
        Image.open(io.BytesIO(inputs[1])).convert("RGB"),  # HF gets the same decoded JPEG
        pil[2].convert("RGB"),
        pil[3].convert("RGB"),
    ]
    proc = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=401408)
    hf_in = proc(images=hf_images, return_tensors="pt")
    ours = enc.preprocess(inputs)
    assert torch.equal(ours.grid_thw, hf_in["image_grid_thw"])
    assert (ours.pixel_values - hf_in["pixel_values"]).abs().max().item() <= 1e-5
    ref = hf_tokens(tower, hf_in["pixel_values"], hf_in["image_grid_thw"])
    counts = [int(t * h * w) // 4 for t, h, w in hf_in["image_grid_thw"].tolist()]
    for out, mean, r in zip(enc.encode(inputs), enc.encode(inputs, "mean"), torch.split(ref, counts), strict=True):
        assert rel_err(out, r) <= 1e-5
        assert rel_err(mean, r.mean(0)) <= 1e-5


def test_fullatt_indexes_past_depth_are_ignored_as_in_hf(tmp_path):
    """transformers runs block i with full attention iff `i in fullatt_block_indexes`, so indexes past the
    depth (its default (7, 15, 23, 31) on a shallower tower, as `save_pretrained` writes it) name no block:
    such a checkpoint loads and encodes as in transformers, not refused."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from tests.hf_models import VISION_25, _randomize

    tower = Qwen2_5_VisionTransformerPretrainedModel(
        Qwen2_5_VLVisionConfig(**dict(VISION_25, fullatt_block_indexes=[2, 7, 15, 23, 31]))
    )
    _randomize(tower, 0)
    tower.eval().save_pretrained(tmp_path)
    enc = encoder.load(str(tmp_path), device="cpu", dtype=torch.float32)
    assert [blk.full_attention for blk in enc.model.blocks] == [False, False, True]
    grid = torch.tensor(GRIDS)
    pv = torch.randn(int(grid.prod(1).sum()), enc.config.patch_dim, generator=torch.Generator().manual_seed(4))
    ref = hf_tokens(tower, pv, grid)
    assert rel_err(enc.forward_packed(encoder.PatchBatch(pv, grid)), ref) <= 1e-5


def test_a_checkpoint_loads_straight_into_the_target_dtype(checkpoint):
    """The checkpoint path materialises the tower in the final dtype and copies the stored tensors in (no float32
    copy first): in bfloat16 every weight equals the stored tensor rounded once, as a float32 load cast after."""
    directory, _ = checkpoint
    want = encoder.load(str(directory), device="cpu", dtype=torch.float32).model.to(torch.bfloat16).state_dict()
    got = encoder.load(str(directory), device="cpu", dtype=torch.bfloat16).model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype, name
        assert torch.equal(tensor, want[name]), name
