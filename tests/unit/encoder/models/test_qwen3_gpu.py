"""The Qwen3-VL tower (8B vision config, DeepStack) on the GPU: bf16 vs float32, graph replay vs
eager on random splits (tokens and every DeepStack feature), every attention backend captures it."""

from __future__ import annotations

import random

import pytest
import torch

import encoder
import workspace
from encoder.attention import available_backends
from tests.graph_cases import GRAPH_BACKENDS, bf16_twin, graphs_only, random_batch, rel_err, split_grids

pytestmark = pytest.mark.gpu
MODEL = "qwen3-vl-8b"


@pytest.fixture(scope="module")
def fp32():
    return encoder.load(MODEL, device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module", params=GRAPH_BACKENDS)
def bf16(fp32, request):
    return bf16_twin(fp32, request.param)


@pytest.fixture(scope="module")
def graph(bf16):
    return graphs_only(workspace.GraphEncoder(bf16, debug=True))  # the default table: every bucket the service captures


def assert_llm_close(outs, refs, tol):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        assert o.grid_thw == r.grid_thw
        assert len(o.deepstack) == len(r.deepstack) == 3
        for a, b in zip([o.tokens, *o.deepstack], [r.tokens, *r.deepstack], strict=True):
            assert a.shape == b.shape and torch.isfinite(a).all()
            assert rel_err(a, b) <= tol, rel_err(a, b)


def test_bf16_matches_fp32(fp32, bf16):
    batch = random_batch([[1, 14, 14], [1, 28, 20], [1, 56, 40]], fp32.config.patch_dim, seed=0)
    assert_llm_close(bf16.encode_llm(batch), fp32.encode_llm(batch), 1e-2)


def test_graph_random_splits(graph, bf16, fp32):
    """Totals repeat, splits differ: replay == eager within bf16 noise, and within 1e-2 of float32."""
    rng = random.Random(1)
    totals = [256, 1024, 4096, 4092, 16384]
    for case in range(200):
        grids = split_grids(totals[case % len(totals)], rng, max_side=64)
        batch = random_batch(grids, fp32.config.patch_dim, seed=case)
        out = graph.encode_llm(batch)
        assert_llm_close(out, bf16.encode_llm(batch), 1e-2)
        if case % 10 == 0:
            assert_llm_close(out, fp32.encode_llm(batch), 1e-2)
    assert sum(graph.stats()["replays"].values()) >= 200


def test_outputs_are_written_every_replay(graph, bf16):
    """Outputs poisoned with NaN between replays come back finite and equal: every row is rewritten."""
    batch = random_batch([[1, 20, 36], [1, 14, 14]], bf16.config.patch_dim, seed=5)
    first = graph.encode_llm(batch)
    with torch.inference_mode():  # the outputs were made inside the graph, under inference mode
        for ws in graph.runner.workspaces.values():
            ws.pixel_values.fill_(float("nan"))  # padding rows stay NaN: none may leak
            for t in ws.out.tensors():
                t.fill_(float("nan"))
    second = graph.encode_llm(batch)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert all(torch.equal(x, y) for x, y in zip(a.deepstack, b.deepstack, strict=True))


@pytest.mark.parametrize("backend", [n for n, why in available_backends().items() if why is None] + ["auto"])
def test_every_available_backend_captures(fp32, backend):
    enc = bf16_twin(fp32, backend)
    graph = graphs_only(workspace.GraphEncoder(enc, buckets="256,4096"))
    rng = random.Random(2)
    for case in range(6):
        batch = random_batch(split_grids([256, 4096][case % 2], rng, max_side=48), enc.config.patch_dim, seed=case)
        assert_llm_close(graph.encode_llm(batch), fp32.encode_llm(batch), 1e-2)


def test_qwen35_without_deepstack_and_12_heads():
    """Qwen3.5's tower (no DeepStack; 12 heads in the 0.8B: not a power of two) through graph replay."""
    fp32 = encoder.load("qwen3.5-0.8b", device="cuda", dtype=torch.float32)
    enc = bf16_twin(fp32)
    graph = workspace.GraphEncoder(enc, buckets="256,1024")
    batch = random_batch([[1, 14, 14], [1, 8, 20], [1, 40, 40]], fp32.config.patch_dim, seed=9)  # last one eager
    for o, r in zip(graph.encode_llm(batch), fp32.encode_llm(batch), strict=True):
        assert o.deepstack == [] and r.deepstack == [] and o.grid_thw == r.grid_thw
        assert torch.isfinite(o.tokens).all() and rel_err(o.tokens, r.tokens) <= 1e-2
