"""Random packed batches for graph-vs-eager tests: same totals, different image splits."""

from __future__ import annotations

import copy
import random

import torch

import encoder
from encoder.attention import available_backends, resolve_attention


def split_grids(total: int, rng: random.Random, max_side: int = 24, max_images: int = 64) -> list[list[int]]:
    """Image grids (1, h, w), h and w even, whose patches sum exactly to `total` (a multiple of 4)."""
    assert total % 4 == 0
    grids, left = [], total
    while left and len(grids) < max_images - 1:
        h, w = 2 * rng.randint(1, max_side // 2), 2 * rng.randint(1, max_side // 2)
        if h * w > left:
            break
        grids.append([1, h, w])
        left -= h * w
    if left:
        grids.append([1, 2, left // 2])  # the remainder as one thin image
    rng.shuffle(grids)
    return grids


def random_batch(grids: list[list[int]], patch_dim: int, seed: int) -> encoder.PatchBatch:
    grid = torch.tensor(grids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    pv = torch.randn(int(grid.prod(1).sum()), patch_dim, generator=gen)
    return encoder.PatchBatch(pv, grid)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def bf16_twin(fp32: encoder.VisionEncoder, attention="auto") -> encoder.VisionEncoder:
    """The same encoder with a bfloat16 copy of its tower (GPU tests compare the two), its attention
    chosen for bf16 (`auto`, or a backend name: FA4 runs only in 16-bit types)."""
    enc = copy.copy(fp32)
    tower = enc.model = copy.deepcopy(fp32.model).to(torch.bfloat16)
    head_dim = fp32.config.head_dim
    tower.set_backend(resolve_attention(attention, tower.attention_kinds, fp32.device, torch.bfloat16, head_dim))
    return enc


# what the GPU suites run their whole-table graph tests with: the default, and FA4 where it is installed
GRAPH_BACKENDS = ["auto"] + (["fa4"] if available_backends().get("fa4") is None else [])


def graphs_only(graph):
    """`graph` (a `workspace.GraphEncoder`) with every pack a bucket takes replayed through its graph: no large,
    much-padded pack run eagerly at its exact size (`GraphRunner.exact_min_patches`), for tests of replay."""
    graph.runner.exact_min_patches = None
    return graph
