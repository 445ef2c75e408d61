"""Fused Triton kernels against their torch references: CPU interpreter (fp32) and GPU (bf16)."""

from __future__ import annotations

import pytest
import torch

import encoder
from encoder import kernels
from tests.graph_cases import random_batch, rel_err

needs_triton = pytest.mark.skipif(kernels.triton is None, reason="triton is not installed")


def cases(device, dtype, rows, width=80 * 4, heads=4):
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    angles = torch.randn(rows, width // heads // 2, generator=gen)
    emb = torch.cat([angles, angles], -1).to(device)
    return r, emb.cos(), emb.sin()


def run_both(monkeypatch, fn, *args):
    monkeypatch.setattr(kernels, "fused", lambda x: False)
    ref = fn(*args)
    monkeypatch.setattr(kernels, "fused", lambda x: True)
    got = fn(*args)
    return got, ref


def check_kernels(monkeypatch, device, dtype, rows, tol):
    r, cos, sin = cases(device, dtype, rows)
    x, res, w, b = r(rows, 96), r(rows, 96), r(96), r(96)
    for rms in (True, False):
        for residual in (res, None):
            (s_got, y_got), (s_ref, y_ref) = run_both(monkeypatch, kernels.add_norm, x, residual, w, b, 1e-6, rms)
            assert rel_err(s_got, s_ref) <= tol and rel_err(y_got, y_ref) <= tol, (rms, residual is None)
    qkv = r(rows, 3 * 320)
    got, ref = run_both(monkeypatch, kernels.rotary_qkv, qkv, cos, sin, 4)
    for g, e in zip(got, ref, strict=True):
        assert g.shape == e.shape and g.is_contiguous()
        assert rel_err(g, e) <= tol
    # a head count that is not a power of two (Qwen3.5-0.8B: 12 heads)
    angles = torch.randn(rows, 12, generator=torch.Generator().manual_seed(1)).to(device)
    cos12, sin12 = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    got, ref = run_both(monkeypatch, kernels.rotary_qkv, r(rows, 3 * 12 * 24), cos12, sin12, 12)
    assert all(rel_err(g, e) <= tol for g, e in zip(got, ref, strict=True))
    gu = r(rows, 2 * 200)
    got, ref = run_both(monkeypatch, kernels.silu_mul, gu)
    assert rel_err(got, ref) <= tol
    h = r(rows, 300)
    got, ref = run_both(monkeypatch, kernels.quick_gelu, h)
    assert rel_err(got, ref) <= tol


@needs_triton
def test_kernels_interpreted_fp32(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the GPU test covers this")
    check_kernels(monkeypatch, "cpu", torch.float32, rows=5, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_gpu(monkeypatch, dtype):
    check_kernels(monkeypatch, "cuda", dtype, rows=1000, tol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2-vl"])
def test_fuse_is_exact(name):
    enc = encoder.load(name, device="cpu")
    batch = random_batch([[1, 8, 12], [1, 6, 6]], enc.config.patch_dim, seed=0)
    before = enc.encode(batch)
    enc.model.fuse(128)
    after = enc.encode(batch)
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(after, before, strict=True))
