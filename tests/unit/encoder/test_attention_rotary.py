"""`forward_rotary` (the Triton kernel rotating q and k itself) against rotary-then-attention in float64:
real rows match, padding rows of the output are zeroed, q / k / v are left as they were. CPU through
Triton's interpreter (fp32), GPU on the device (bf16, graph-sized cases)."""

from __future__ import annotations

import pytest
import torch

from encoder.attention import get_backend
from encoder.attention.triton_varlen import ROTARY_MAX_SEQLEN, triton
from encoder.kernels import _rotate_half
from tests.unit.encoder.test_attention import reference

needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed")


def check_rotary(device, dtype, lengths, trailing, pad, heads, head_dim, tol, seed=0):
    g = torch.Generator().manual_seed(seed)
    real = sum(lengths)
    total = real + pad
    qkv = torch.randn(total, 3, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    angles = torch.randn(total, head_dim // 2, generator=g) * 20  # large angles, like far positions
    emb = torch.cat([angles, angles], -1).to(device)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds + [bounds[-1]] * trailing, dtype=torch.int32, device=device)
    q, k, v = qkv.unbind(1)
    before = qkv.clone()
    out = torch.full((total, heads, head_dim), float("nan"), dtype=dtype, device=device)
    backend = get_backend("triton")
    offered = backend.rotary_backend(max(lengths), head_dim)
    assert offered is (backend if max(lengths) <= ROTARY_MAX_SEQLEN else None)
    backend.forward_rotary(q, k, v, cu, max(lengths), out, cos, sin)

    def rot(x):  # kernels.rotary_qkv's reference: float32 math, rounded to the input dtype
        xf = x.float()
        return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)

    ref = reference(rot(q), rot(k), v, cu)
    got = out[:real].double().cpu()
    assert torch.isfinite(got).all(), "rows inside segments left unwritten"
    err = ((got - ref[:real]).abs().max() / ref[:real].abs().max()).item()
    assert err <= tol, err
    assert not out[real:].any(), "padding rows must be zeroed"
    assert torch.equal(qkv, before), "q, k, v must not be written"


@needs_triton
@pytest.mark.parametrize("case", [([5, 9, 3], 2, 3), ([16], 0, 0), ([7, 1], 3, 17)], ids=["3seg", "1seg", "pad"])
def test_forward_rotary_interpreted(case):
    if torch.cuda.is_available():
        pytest.skip("the GPU test covers this")
    lengths, trailing, pad = case
    check_rotary("cpu", torch.float32, lengths, trailing, pad, heads=2, head_dim=80, tol=1e-5)


GPU_CASES = [([256], 0, 0), ([64] * 16, 4, 96), ([1024, 300], 2, 700)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=["1x256", "windows", "long"])
def test_forward_rotary_gpu(case):
    lengths, trailing, pad = case
    check_rotary("cuda", torch.bfloat16, lengths, trailing, pad, heads=16, head_dim=80, tol=1e-2)
