"""Layers the towers share: RMSNorm, the rotary QKV attention of the Qwen towers, activations by name.

A tower imports these, never another tower (`tests/unit/test_architecture.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.kernels.elementwise import add_norm, gelu_tanh, quick_gelu, rotary_qkv
from encoder.models.fp8 import takes_fp8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return add_norm(x, None, self.weight, None, self.eps, rms=True)[1]


def norm_args(norm: nn.Module):
    """(weight, bias, eps, rms) of an RMSNorm or LayerNorm, for `add_norm`."""
    return norm.weight, getattr(norm, "bias", None), norm.eps, isinstance(norm, RMSNorm)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.backend: AttentionBackend | None = None  # set by the tower

    def reads_fp8(self) -> bool:
        return takes_fp8(self.qkv)

    def forward(self, x, cu_seqlens, max_seqlen, cos, sin):
        # x: [S, D] packed tokens (or Fp8Rows [S, D] when the qkv GEMM is FP8)
        qkv = self.qkv(x)  # [S, 3D] in the model dtype
        s, d = qkv.shape[0], qkv.shape[1] // 3
        # padding rows of `out` are zeroed by the rotary pass (no backend writes them)
        out = torch.empty(s, self.num_heads, d // self.num_heads, dtype=qkv.dtype, device=qkv.device)
        q, k, v = rotary_qkv(qkv, cos, sin, self.num_heads, out, cu_seqlens)  # each [S, H, D/H]
        self.backend(q, k, v, cu_seqlens, max_seqlen, out)
        return self.proj(out.view(s, d))


def activation(h: torch.Tensor, name: str, fp8: bool = False):
    """The activation by its HF name; with `fp8` (the next GEMM is FP8) as Fp8Rows where a kernel writes them,
    else a tensor the FP8 GEMM quantises itself."""
    if name == "quick_gelu":
        return quick_gelu(h, fp8=fp8)  # the fused kernel on CUDA
    if name == "gelu_pytorch_tanh":
        return gelu_tanh(h, fp8=fp8)
    if name == "gelu":
        return F.gelu(h)
    raise ValueError(f"unsupported activation {name!r}")
