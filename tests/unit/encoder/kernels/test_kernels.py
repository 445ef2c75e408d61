"""Fused Triton kernels against their torch references: CPU interpreter (fp32) and GPU (bf16)."""

from __future__ import annotations

import pytest
import torch

import encoder
from encoder.kernels import elementwise as kernels
from encoder.models.tower import segment_means
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
    v_before = qkv[:, 640:].clone()
    got, ref = run_both(monkeypatch, kernels.rotary_qkv, qkv, cos, sin, 4)
    for g, e in zip(got, ref, strict=True):
        assert g.shape == e.shape and g.stride(-1) == 1
        assert rel_err(g, e) <= tol
    # the kernel rotates q and k in place and returns views of qkv; v is never written
    assert all(g.data_ptr() == qkv.data_ptr() + i * 320 * qkv.element_size() for i, g in enumerate(got))
    assert torch.equal(qkv[:, 640:], v_before)
    # with the attention output buffer: its padding rows (past cu[-1]) are zeroed, the others untouched
    for use_kernel in (False, True):
        monkeypatch.setattr(kernels, "fused", lambda x, k=use_kernel: k)
        out = torch.full((rows, 4, 80), float("nan"), dtype=dtype, device=device)
        cu = torch.tensor([0, rows // 2, rows - 2], dtype=torch.int32, device=device)
        kernels.rotary_qkv(r(rows, 3 * 320), cos, sin, 4, out, cu)
        assert out[: rows - 2].isnan().all() and not out[rows - 2 :].any(), use_kernel
    # a head count that is not a power of two (Qwen3.5-0.8B: 12 heads)
    angles = torch.randn(rows, 12, generator=torch.Generator().manual_seed(1)).to(device)
    cos12, sin12 = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    got, ref = run_both(monkeypatch, kernels.rotary_qkv, r(rows, 3 * 12 * 24), cos12, sin12, 12)
    assert all(rel_err(g, e) <= tol for g, e in zip(got, ref, strict=True))
    out = r(rows, 4, 20)
    cu = torch.tensor([0, rows // 3, rows // 2, rows // 2], dtype=torch.int32, device=device)
    out[rows // 2 :] = float("nan")
    got, ref = run_both(monkeypatch, lambda o: kernels.zero_rows_past(o.clone(), cu), out)
    assert torch.equal(got, ref) and torch.equal(got[: rows // 2], out[: rows // 2]) and not got[rows // 2 :].any()
    gu = r(rows, 2 * 200)
    got, ref = run_both(monkeypatch, kernels.silu_mul, gu)
    assert rel_err(got, ref) <= tol
    h = r(rows, 300)
    got, ref = run_both(monkeypatch, kernels.quick_gelu, h)
    assert rel_err(got, ref) <= tol
    # per-slot means: boundaries in patches (divisor 2), an empty slot, NaN in the padding rows
    toks = r(rows, 300)
    q = rows // 5
    toks[4 * q :] = float("nan")
    cu = torch.tensor([0, 2 * q, 2 * q, 8 * q], dtype=torch.int32, device=device)
    got, ref = run_both(monkeypatch, segment_means, toks, cu, 3, 2)
    assert got.dtype == torch.float32 and torch.isfinite(got).all() and not got[1].any()
    assert rel_err(got, ref) <= 1e-5


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


@pytest.mark.gpu
def test_gemm_epilogues_gpu():
    """The cuBLAS paths against float64 references: the GELU epilogue is the tanh approximation (not
    the exact erf the CPU op uses), and the split float32 patch GEMM keeps ~16 bits of each pixel."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(777, 1152, generator=gen)
    lin = torch.nn.Linear(1152, 4352).to(torch.bfloat16)
    w64, b64 = lin.weight.double(), lin.bias.double()
    got = kernels.linear_gelu_tanh(x.to("cuda", torch.bfloat16), lin.cuda()).double().cpu()
    pre = x.to(torch.bfloat16).double() @ w64.t() + b64
    assert rel_err(got, F.gelu(pre, approximate="tanh")) <= 1e-2
    assert (got - F.gelu(pre, approximate="tanh")).abs().max() < (got - F.gelu(pre)).abs().max()

    pixels = torch.randn(777, 1536, generator=gen) * 2
    w = torch.randn(1152, 1536, generator=gen).to(torch.bfloat16)
    bias = torch.randn(1152, generator=gen).to(torch.bfloat16)
    got = kernels.linear_float32_out(pixels.cuda(), w.cuda(), bias.cuda())
    assert got.dtype == torch.float32
    ref = pixels.double() @ w.double().t() + bias.double()
    rounded = pixels.to(torch.bfloat16).double() @ w.double().t() + bias.double()
    assert rel_err(got.double().cpu(), ref) <= 1e-4 < rel_err(rounded, ref)
