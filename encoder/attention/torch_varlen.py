"""Varlen attention on PyTorch's own `torch.nn.attention.varlen` (Flash Attention 2 kernels in aten).

The API takes separate cumulative offsets for queries and keys plus `max_q`/`max_k`; for
self-attention both are our `cu_seqlens` and `max_seqlen`. Newer torch (2.12+) has
`varlen_attn_out`, which writes straight into `out`; older releases (2.9-2.11) only return a fresh
tensor. That tensor comes from `empty_like`, so its rows past `cu_seqlens[-1]` (bucket padding) are
uninitialised memory: we copy only rows inside segments, selected on the device, into `out`.

The flash kernels exist only for CUDA (there is no CPU implementation), and only in fp16/bf16.
Launches are capturable in a CUDA graph, with `cu_seqlens` rewritten in place between replays.

`torch.nn.attention.varlen` is imported only where CUDA is: importing it pulls in `torch._dynamo`, 2.6 s of
CPU per process (every replica, batch actor and `encoder.load` asks the registry what is available), for a
backend that cannot run without CUDA anyway.
"""

from __future__ import annotations

import functools

import torch

from encoder.attention.base import AttentionBackend

_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _varlen_functions() -> tuple:
    """(varlen_attn, varlen_attn_out), each None where this torch lacks it (varlen_attn_out: 2.12+)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:  # torch < 2.9
        return None, None
    return getattr(varlen, "varlen_attn", None), getattr(varlen, "varlen_attn_out", None)


def _keep_real_rows(out: torch.Tensor, result: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Copy `result` into `out` for rows below cu_seqlens[-1]; padding rows of `out` stay as they were.

    `result`'s padding rows may hold garbage (NaN/Inf), so they are masked by selection, never by
    arithmetic. The row count is compared on the device: no host read of cu_seqlens.
    """
    rows = torch.arange(out.shape[0], device=out.device)
    real = (rows < cu_seqlens[-1].long())[:, None, None]
    out.copy_(torch.where(real, result, out))
    return out


class TorchVarlenAttention(AttentionBackend):
    name = "torch_varlen"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():  # checked first: the import below is slow and useless without CUDA
            return "torch varlen_attn runs only on CUDA (flash kernels, no CPU implementation)"
        if _varlen_functions() == (None, None):
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (needs >= 2.9)"
        return None

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return "torch varlen_attn runs only on CUDA"
        if dtype not in _DTYPES:
            return f"dtype {dtype} not supported (flash kernels are fp16/bf16 only)"
        if head_dim > 256 or head_dim % 8:
            return f"head_dim {head_dim} not supported (flash kernels need a multiple of 8, <= 256)"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "flash kernels need compute capability >= 8.0"
        return None

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        # the flash kernels require unit stride on the head dim
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        _varlen_attn, _varlen_attn_out = _varlen_functions()
        if _varlen_attn_out is not None and out.stride(-1) == 1:
            # writes rows inside segments only; padding rows of `out` are left untouched
            _varlen_attn_out(out, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
            return out
        # positional call: the first seven parameters are stable across 2.9 .. 2.13
        result = _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
        return _keep_real_rows(out, result, cu_seqlens)
