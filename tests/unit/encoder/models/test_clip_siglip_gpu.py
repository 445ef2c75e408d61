"""Real-size CLIP ViT-L/14 and SigLIP so400m/14-384 on the GPU: bf16 vs float32, graph replay vs eager,
every capturable attention backend, padding and capture cost. Random weights (the presets)."""

from __future__ import annotations

import random

import pytest
import torch

import encoder
import workspace
from encoder.attention import available_backends
from tests.graph_cases import GRAPH_BACKENDS, bf16_twin, graphs_only, rel_err
from tests.images_util import encode, random_image
from workspace.tables import image_count_table

pytestmark = pytest.mark.gpu
MODELS = ["clip-vit-l-14", "siglip-so400m-14-384"]
TOL = 1e-2  # bf16 against float32 (measured on CPU: <= 5e-3 for both presets, every pooling)


@pytest.fixture(scope="module", params=MODELS)
def fp32(request):
    return encoder.load(request.param, device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module", params=GRAPH_BACKENDS)
def bf16(fp32, request):
    return bf16_twin(fp32, request.param)


@pytest.fixture(scope="module")
def graph(bf16):
    # default table: 1, 2, 4, ..., 256 images (capped by the backend); fuses q/k/v and pads the MLP in
    # place, so `bf16` (same model) is the eager reference of the same layout
    return graphs_only(workspace.GraphEncoder(bf16, debug=True))


def random_batch(enc, n: int, seed: int) -> encoder.PatchBatch:
    cfg = enc.config
    gen = torch.Generator().manual_seed(seed)
    pv = torch.randn(n * cfg.num_patches, cfg.patch_dim, generator=gen)
    return encoder.PatchBatch(pv, torch.tensor([[1, cfg.grid, cfg.grid]] * n))


def assert_close(outs, refs, tol):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape
        assert torch.isfinite(o).all()
        assert rel_err(o, r) <= tol, rel_err(o, r)


def test_bf16_matches_fp32(fp32, bf16):
    batch = random_batch(fp32, 3, seed=0)
    for pooling in ("model", "mean", "none"):
        assert_close(bf16.encode(batch, pooling), fp32.encode(batch, pooling), TOL)


def test_capture_cost(graph):
    s = graph.stats()
    assert s["captures"] == len(graph.table)
    per = graph.config.num_patches
    assert all(k.budget == k.max_images * per for k in graph.table)  # buckets are image counts
    if graph.encoder.model.backend.max_graph_tokens is None:  # triton, torch_varlen: up to 256 images
        assert graph.table.largest.max_images == 256
    assert s["capture_seconds"] <= 60, s
    assert s["capture_bytes"] <= 16 * 2**30, s


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 33, 128, 256, 257, 300])
def test_graph_matches_eager(graph, bf16, fp32, n):
    """Every image count, bucket edges and more than the largest bucket (split into replays)."""
    batch = random_batch(bf16, n, seed=n)
    before = sum(graph.stats()["replays"].values())
    for pooling in ("model", "mean"):
        assert_close(graph.encode(batch, pooling), bf16.encode(batch, pooling), TOL)
    if n <= 33:
        assert_close(graph.encode(batch, "none"), bf16.encode(batch, "none"), TOL)
        assert_close(graph.encode(batch, "model"), fp32.encode(batch, "model"), TOL)
    assert sum(graph.stats()["replays"].values()) > before
    assert graph.stats()["eager_runs"] == 0


def test_random_image_counts(graph, bf16):
    """200 random image counts (totals repeat, so replays of one graph see different fills)."""
    rng = random.Random(7)
    for case in range(200):
        n = rng.randint(1, 40)
        batch = random_batch(bf16, n, seed=1000 + case)
        assert_close(graph.encode(batch, "model"), bf16.encode(batch, "model"), TOL)
    assert graph.stats()["eager_runs"] == 0


def test_padding_and_repeatability(graph, bf16):
    batch = random_batch(bf16, 3, seed=5)  # the 4-image bucket: one padding slot
    first = graph.encode(batch, "model")
    for ws in graph.runner.workspaces.values():
        ws.pixel_values.fill_(float("nan"))  # padding rows stay NaN: none may leak
    second = graph.encode(batch, "model")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    tokens = graph.encode(batch, "none")
    assert all(torch.equal(a, b) for a, b in zip(tokens, graph.encode(batch, "none"), strict=True))


def test_images_end_to_end(graph, fp32):
    images = [encode(random_image("RGB", 300 + 40 * i, 500 - 30 * i, seed=i), "JPEG") for i in range(6)]
    assert_close(graph.encode(images, "model-l2"), fp32.encode(images, "model-l2"), TOL)


@pytest.mark.parametrize("backend", [n for n, why in available_backends().items() if why is None] + ["auto"])
def test_every_available_backend_captures(fp32, backend):
    enc = bf16_twin(fp32, backend)
    g = workspace.GraphEncoder(enc, buckets=image_count_table([1, 4, 16], enc.config.num_patches))
    batch = random_batch(enc, 6, seed=6)
    for pooling in ("model", "none"):
        assert_close(g.encode(batch, pooling), fp32.encode(batch, pooling), TOL)
