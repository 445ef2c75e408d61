"""Videos through the graphs on the GPU (issue 47): random mixes of videos and images, bf16, real-size Qwen towers
(random weights); graph replay == eager (same attention backend) for tokens, DeepStack features and means, with
videos larger than a bucket split across packs, and one video larger than every bucket."""

from __future__ import annotations

import random

import pytest
import torch

import encoder
import workspace
from encoder.patch_batch import PatchBatch
from tests.graph_cases import bf16_twin, graphs_only, rel_err

pytestmark = pytest.mark.gpu
MODELS = ["qwen3-vl-8b", "qwen2.5-vl-7b"]  # DeepStack and window attention


@pytest.fixture(scope="module", params=MODELS)
def bf16(request):
    fp32 = encoder.load(request.param, device="cuda", dtype=torch.float32)
    return bf16_twin(fp32)


@pytest.fixture(scope="module")
def graph(bf16):
    # small buckets so videos spill over several packs and share them with images
    return graphs_only(workspace.GraphEncoder(bf16, buckets="1024,4096,8192"))


def random_mix(rng: random.Random, patch_dim: int, seed: int) -> PatchBatch:
    """1-5 items, each an image (t = 1) or a video (t = 2-12 temporal patches), sides even, 2-40 patches."""
    grids = []
    for _ in range(rng.randint(1, 5)):
        t = 1 if rng.random() < 0.4 else rng.randint(2, 12)
        grids.append([t, 2 * rng.randint(1, 20), 2 * rng.randint(1, 20)])
    grid = torch.tensor(grids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    pv = torch.randn(int(grid.prod(1).sum()), patch_dim, generator=gen)  # never zeros
    return PatchBatch(pv, grid)


def assert_llm_close(got, want, tol=1e-2):
    for g, w in zip(got, want, strict=True):
        assert g.grid_thw == w.grid_thw and g.tokens.shape == w.tokens.shape
        assert torch.isfinite(g.tokens).all() and rel_err(g.tokens, w.tokens) <= tol, rel_err(g.tokens, w.tokens)
        assert len(g.deepstack) == len(w.deepstack)
        for gd, wd in zip(g.deepstack, w.deepstack, strict=True):
            assert rel_err(gd, wd) <= tol


def test_random_mixes_of_videos_and_images(graph, bf16):
    rng = random.Random(7)
    for case in range(40):
        batch = random_mix(rng, bf16.config.patch_dim, seed=case)
        assert_llm_close(graph.encode_llm(batch), bf16.encode_llm(batch))
        if case % 4 == 0:
            for g, e in zip(graph.encode(batch, "mean"), bf16.encode(batch, "mean"), strict=True):
                assert rel_err(g, e) <= 1e-2
    stats = graph.stats()
    assert stats["videos"] >= 20 and sum(stats["replays"].values()) >= 40


def test_a_video_larger_than_every_bucket(graph, bf16):
    """64 frames of 448² (32 temporal patches): far over the 8,192 bucket, split at frame pairs into packs."""
    g = 448 // bf16.config.patch_size  # 32 (patch 14) or 28 (patch 16): even, as merging needs
    batch = PatchBatch(torch.randn(32 * g * g, bf16.config.patch_dim, generator=torch.Generator().manual_seed(1)),
                       torch.tensor([[32, g, g]]))  # fmt: skip
    assert 32 * g * g > graph.table.largest.budget
    before = sum(graph.stats()["replays"].values())
    assert_llm_close(graph.encode_llm(batch), bf16.encode_llm(batch))
    assert sum(graph.stats()["replays"].values()) - before >= 2
