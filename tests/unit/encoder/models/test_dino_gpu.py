"""DINOv2-L, DINOv2-L with registers and DINOv3 ViT-L/16 on the GPU: bf16 vs float32, graph replay vs eager over
image counts (bucket edges, more than the largest bucket, random counts), padding slots that stay out. Random
weights (the presets); HF parity is the CPU tests' (`test_dinov2.py`, `test_dinov3.py`) and, in bf16 on the GPU,
`benchmarks/towers.py`'s."""

from __future__ import annotations

import random

import pytest
import torch

import encoder
import workspace
from tests.graph_cases import GRAPH_BACKENDS, bf16_twin, graphs_only, rel_err
from workspace.tables import image_count_table

pytestmark = pytest.mark.gpu
MODELS = ["dinov2-large", "dinov2-with-registers-large", "dinov3-vitl16"]
TOL = 1e-2  # graph replay against the eager bf16 tower (the same layout)
# bf16 against float32: measured on CPU (2 images of random patch rows) up to 9.7e-3 for DINOv2-L's pooled class
# token, 4e-3 for its patch tokens and their mean
BF16_TOL = 2e-2


@pytest.fixture(scope="module", params=MODELS)
def fp32(request):
    return encoder.load(request.param, device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module", params=GRAPH_BACKENDS)
def bf16(fp32, request):
    return bf16_twin(fp32, request.param)


@pytest.fixture(scope="module")
def graph(bf16):
    # a small image-count table (the default one, 1 .. 256 images, is the benchmark's); fuses q/k/v and pads the
    # MLP in place, so `bf16` (same model) is the eager reference of the same layout
    table = image_count_table([1, 2, 4, 16, 64], bf16.config.num_patches)
    return graphs_only(workspace.GraphEncoder(bf16, buckets=table, debug=True))


def random_batch(enc, n: int, seed: int) -> encoder.PatchBatch:
    cfg = enc.config
    gen = torch.Generator().manual_seed(seed)
    pv = torch.randn(n * cfg.num_patches, cfg.patch_dim, generator=gen)
    return encoder.PatchBatch(pv, torch.tensor([[1, cfg.grid, cfg.grid]] * n))


def assert_close(outs, refs, tol: float = TOL):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape and torch.isfinite(o).all()
        assert rel_err(o, r) <= tol, rel_err(o, r)


def test_bf16_matches_fp32(fp32, bf16):
    batch = random_batch(fp32, 3, seed=0)
    for pooling in ("model", "mean", "none"):
        assert_close(bf16.encode(batch, pooling), fp32.encode(batch, pooling), BF16_TOL)


@pytest.mark.parametrize("n", [1, 3, 16, 17, 64, 100])
def test_graph_matches_eager(graph, bf16, n):
    batch = random_batch(bf16, n, seed=n)
    before = sum(graph.stats()["replays"].values())
    for pooling in ("model", "mean"):
        assert_close(graph.encode(batch, pooling), bf16.encode(batch, pooling))
    if n <= 16:
        assert_close(graph.encode(batch, "none"), bf16.encode(batch, "none"))
    assert sum(graph.stats()["replays"].values()) > before
    assert graph.stats()["eager_runs"] == 0


def test_random_image_counts(graph, bf16):
    """Random image counts: replays of one graph see different fills."""
    rng = random.Random(3)
    for case in range(30):
        batch = random_batch(bf16, rng.randint(1, 40), seed=100 + case)
        assert_close(graph.encode(batch, "model"), bf16.encode(batch, "model"))
    assert graph.stats()["eager_runs"] == 0


def test_padding_slots_stay_out(graph, bf16):
    batch = random_batch(bf16, 3, seed=5)  # the 4-image bucket: one padding slot
    first = graph.encode(batch, "model")
    for ws in graph.runner.workspaces.values():
        ws.pixel_values.fill_(float("nan"))  # whatever the buffers held before, nothing leaks
    second = graph.encode(batch, "model")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
