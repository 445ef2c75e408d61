"""Forward-only flash attention for packed varlen sequences, written in Triton.

One program computes one (query block, head, segment) tile with the online softmax (running max and
sum in fp32, `tl.dot` for QK^T and PV). The launch grid depends only on static things (the number of
query blocks for `max_seqlen`, the number of segments = `cu_seqlens.numel() - 1`, the heads), so a
launch captured in a CUDA graph stays valid when `cu_seqlens` is rewritten in place between replays.
Each program reads its segment's bounds from `cu_seqlens` on the device and exits at once when its
query block starts past the segment end, so empty (padding) segments and short segments cost a few
instructions. Rows past `cu_seqlens[-1]` belong to no segment and are never written.

Block sizes come from a small static table (`_CONFIGS`), never from autotuning: autotune benchmarks
at the first call, which inside graph capture would record the benchmark launches too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from encoder.attention.base import AttentionBackend

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # triton is optional (not on macOS / CPU-only images)
    triton = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


def _interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (TRITON_INTERPRET=1)."""
    if triton is not None:
        try:
            return bool(triton.knobs.runtime.interpret)
        except AttributeError:  # older triton without knobs: it reads the variable itself
            pass
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Retune here. Rows are tried in order; the first whose bounds hold wins:
# (16-bit input?, max_seqlen <=, padded head_dim <=) -> config.
# Rationale: short segments (window attention, 64 tokens) want small query blocks so no program does
# masked-out work and the grid still fills the GPU; long segments want BLOCK_M=128 to reuse each K/V
# tile across more queries. fp32 tiles are twice the bytes and fp32 runs exact (ieee) FMA dots, so its
# tiles are smaller; head dims above 128 halve BLOCK_N to fit registers. Checked offline by compiling
# every row for sm_90 (triton 3.9): no register spills, <= 128 KiB shared memory (Hopper has 227).
# BLOCK_M=128 wants 8 warps: with 4 its accumulator spills at D=80/128.
_CONFIGS: list[tuple[bool, int, int, KernelConfig]] = [
    (True, 64, 128, KernelConfig(64, 64, 4, 2)),
    (True, 256, 128, KernelConfig(64, 64, 4, 3)),
    (True, 1 << 30, 64, KernelConfig(128, 64, 4, 3)),
    (True, 1 << 30, 128, KernelConfig(128, 64, 8, 3)),
    (True, 1 << 30, 256, KernelConfig(64, 32, 4, 2)),
    (False, 1 << 30, 128, KernelConfig(64, 32, 8, 2)),
    (False, 1 << 30, 256, KernelConfig(16, 16, 4, 1)),
]


def pick_config(dtype: torch.dtype, head_dim: int, max_seqlen: int) -> KernelConfig:
    """The launch config for one call; pure function of static things, so graph-safe."""
    block_d = _block_d(head_dim)
    half = dtype in (torch.float16, torch.bfloat16)
    matches = (
        c for is_half, seq_le, d_le, c in _CONFIGS if is_half == half and max_seqlen <= seq_le and block_d <= d_le
    )
    cfg = next(matches, None)
    if cfg is None:
        raise ValueError(f"no triton config for dtype={dtype} head_dim={head_dim}")
    # never use blocks much larger than the longest segment (tl.dot needs >= 16)
    cap = max(16, triton.next_power_of_2(max(1, max_seqlen)))
    return KernelConfig(min(cfg.block_m, cap), min(cfg.block_n, cap), cfg.num_warps, cfg.num_stages)


def _block_d(head_dim: int) -> int:
    # tl.arange needs a power of two and tl.dot needs K >= 16; the tail is masked off
    return max(16, 1 << (head_dim - 1).bit_length())


if triton is not None:

    @triton.jit
    def _varlen_fwd_kernel(
        Q,
        K,
        V,
        Out,
        CU,
        qk_scale,  # 1/sqrt(head_dim) * log2(e): the softmax runs on exp2
        stride_qs,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_os,
        stride_oh,
        num_heads,
        num_m_blocks,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # 1-D grid (axis 0 allows 2^31 programs; axes 1/2 stop at 65535, which many small windows
        # times heads could pass). Query block varies fastest so the programs sharing one segment's
        # K/V run together and hit L2.
        pid = tl.program_id(0)
        m_block = pid % num_m_blocks
        rest = pid // num_m_blocks
        head = rest % num_heads
        seg = rest // num_heads

        seg_start = tl.load(CU + seg)
        seg_len = tl.load(CU + seg + 1) - seg_start
        if m_block * BLOCK_M >= seg_len:
            return  # empty segment, or a query block past a short segment's end

        # int64 row offsets: rows * stride can pass 2^31 for big buckets of packed qkv
        base = seg_start.to(tl.int64)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        m_ok = offs_m < seg_len

        q_ptrs = Q + (base + offs_m)[:, None] * stride_qs + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        for n0 in range(0, seg_len, BLOCK_N):
            rows_n = n0 + offs_n
            n_ok = rows_n < seg_len
            # K loaded transposed [BLOCK_D, BLOCK_N] so QK^T is a plain dot
            k_ptrs = K + (base + rows_n)[None, :] * stride_ks + head * stride_kh + offs_d[:, None]
            k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            # the first tile always holds >= 1 real key, so m_new is finite from the start
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = V + (base + rows_n)[:, None] * stride_vs + head * stride_vh + offs_d[None, :]
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        o_ptrs = Out + (base + offs_m)[:, None] * stride_os + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


class TritonVarlenAttention(AttentionBackend):
    name = "triton"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if triton is None:
            return f"triton is not importable ({_IMPORT_ERROR})"
        if not torch.cuda.is_available() and not _interpreting():
            return "no CUDA device and TRITON_INTERPRET is not set"
        return None

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if dtype not in _DTYPES:
            return f"dtype {dtype} not supported (fp32, fp16, bf16 only)"
        if head_dim > _MAX_HEAD_DIM:
            return f"head_dim {head_dim} > {_MAX_HEAD_DIM}"
        if torch.device(device).type != "cuda":
            if not _interpreting():
                return "CPU tensors need TRITON_INTERPRET=1"
            if dtype == torch.bfloat16:
                # the interpreter computes bf16 dots wrongly; refuse rather than return bad numbers
                return "bf16 is not computed correctly by the Triton CPU interpreter"
        return None

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        total, heads, head_dim = q.shape
        num_segments = cu_seqlens.numel() - 1
        if total == 0 or num_segments <= 0 or max_seqlen <= 0:
            return out
        # the kernel assumes unit stride on the head dim; other strides are passed through
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        dst = out if out.stride(-1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
        cu = cu_seqlens if cu_seqlens.is_contiguous() else cu_seqlens.contiguous()

        cfg = pick_config(q.dtype, head_dim, max_seqlen)
        num_m_blocks = triton.cdiv(max_seqlen, cfg.block_m)
        grid = (num_m_blocks * heads * num_segments,)
        _varlen_fwd_kernel[grid](
            q,
            k,
            v,
            dst,
            cu,
            (1.0 / math.sqrt(head_dim)) * math.log2(math.e),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            dst.stride(0),
            dst.stride(1),
            heads,
            num_m_blocks,
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            # tf32 would cost fp32 inputs ~1e-3 relative error; fp32 is the accuracy path, not the fast one
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if dst is not out:
            # only rows inside segments were computed; copy those, leave padding rows as they were
            real = torch.arange(total, device=out.device) < cu_seqlens[-1].long()
            out.copy_(torch.where(real[:, None, None], dst, out))
        return out
