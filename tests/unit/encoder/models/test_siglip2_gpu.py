"""SigLIP2 so400m/16 NaFlex on the GPU: bf16 vs float32, graph replay vs eager on random mixes of NaFlex
grids (patch budgets, empty slots, padding rows), every capturable attention backend. Random weights (the
preset); HF parity is the CPU test's (`test_siglip2.py`)."""

from __future__ import annotations

import random

import pytest
import torch

import encoder
import workspace
from tests.graph_cases import GRAPH_BACKENDS, bf16_twin, graphs_only, random_batch, rel_err

pytestmark = pytest.mark.gpu
TOL = 1e-2  # bf16 against float32


@pytest.fixture(scope="module")
def fp32():
    return encoder.load("siglip2-so400m-16-naflex", device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module", params=GRAPH_BACKENDS)
def bf16(fp32, request):
    return bf16_twin(fp32, request.param)


def naflex_grids(rng: random.Random, n: int, max_patches: int = 256) -> list[list[int]]:
    """Grids the processor can give: any aspect ratio, at most `max_patches` patches."""
    out = []
    for _ in range(n):
        h = rng.randint(1, max_patches)
        out.append([1, h, rng.randint(1, max_patches // h)])
    return out


def assert_close(outs, refs, tol):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape and torch.isfinite(o).all()
        assert rel_err(o, r) <= tol, rel_err(o, r)


def test_bf16_matches_fp32(fp32, bf16):
    batch = random_batch(naflex_grids(random.Random(0), 5), fp32.config.patch_dim, seed=0)
    for pooling in ("model", "mean", "none"):
        assert_close(bf16.encode(batch, pooling), fp32.encode(batch, pooling), TOL)


def test_graph_replay_matches_eager(bf16):
    graph = graphs_only(workspace.GraphEncoder(bf16, buckets="256,1024,4096", debug=True))
    rng = random.Random(1)
    for case in range(30):
        batch = random_batch(naflex_grids(rng, rng.randint(1, 24)), bf16.config.patch_dim, seed=case)
        for pooling in ("model", "mean"):
            assert_close(graph.encode(batch, pooling), bf16.encode(batch, pooling), 2e-2)
    assert graph.runner.stats.eager_runs == 0 and sum(graph.runner.stats.replays.values()) >= 30
