"""The one-launch geometry (`encoder.kernels.geometry`) against the torch reference of `compute_meta`:
the integer tables equal, cos/sin within float32 rounding; CPU through Triton's interpreter, GPU on the
device, random frame splits with empty slots and bucket padding."""

from __future__ import annotations

import random

import pytest
import torch

from encoder.kernels import geometry as geometry_fused
from encoder.loading.presets import preset
from encoder.models import geometry

needs_triton = pytest.mark.skipif(geometry_fused.triton is None, reason="triton is not installed")


def random_frames(rng: random.Random, slots: int, m: int, max_side: int) -> list[list[int]]:
    # frame sides in patches are multiples of the merge size; some slots empty (h = w = 0), not only at the end
    frames = [[m * rng.randint(1, max_side // m), m * rng.randint(1, max_side // m)] for _ in range(slots)]
    for i in rng.sample(range(slots), k=rng.randint(0, slots - 1)):
        frames[i] = [0, 0]
    return frames


def both(monkeypatch, frames_hw, total, cfg, max_seqlen, slots):
    monkeypatch.setattr(geometry, "fused", lambda x: False)
    ref = geometry.compute_meta(frames_hw, total, cfg, max_seqlen, slots)
    monkeypatch.setattr(geometry, "fused", lambda x: True)
    got = geometry.compute_meta(frames_hw, total, cfg, max_seqlen, slots)
    return got, ref


def check(monkeypatch, device, name: str, cases: int, max_side: int):
    cfg = preset(name)  # the config only: no weights
    rng = random.Random(0)
    m, mu = cfg.spatial_merge_size, cfg.merge_unit
    for case in range(cases):
        frames = random_frames(rng, rng.randint(1, 5), m, max_side)
        real = sum(h * w for h, w in frames)
        total = real + mu * rng.randint(0, 6)  # bucket padding
        slots = geometry.count_windows([[1, h, w] for h, w in frames], cfg) + rng.randint(0, 3)
        if slots == 0:
            slots = 1
        frames_hw = torch.tensor(frames, dtype=torch.long, device=device)
        got, ref = both(monkeypatch, frames_hw, total, cfg, max(1, max(h * w for h, w in frames)), slots)
        for field in ("cu_seqlens", "cu_window", "window_index", "window_inverse"):
            g, r = getattr(got, field), getattr(ref, field)
            assert (g is None) == (r is None), field
            if r is not None:
                assert g.dtype == r.dtype and torch.equal(g, r), (case, frames, total, field, g, r)
        for field in ("cos", "sin"):
            g, r = getattr(got, field), getattr(ref, field)
            assert g.shape == r.shape and g.dtype == r.dtype
            assert torch.allclose(g, r, atol=2e-6, rtol=0), (case, frames, field, (g - r).abs().max())
        assert got.max_seqlen == ref.max_seqlen and got.max_window == ref.max_window


@needs_triton
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2-vl", "tiny-qwen3-vl"])
def test_fused_meta_interpreted(monkeypatch, name):
    if torch.cuda.is_available():
        pytest.skip("the GPU test covers this")
    check(monkeypatch, "cpu", name, cases=6, max_side=12)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-vl-7b", "qwen2-vl-2b", "qwen3-vl-8b"])
def test_fused_meta_gpu(monkeypatch, name):
    check(monkeypatch, "cuda", name, cases=100, max_side=64)
