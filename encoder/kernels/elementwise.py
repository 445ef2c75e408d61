"""Fused elementwise kernels for the blocks (Triton on CUDA), each with a torch reference.

The profile of an eager forward on the H200 (docs/journal/benchmarks.md) shows unfused elementwise work —
float32 rotary with its cat/neg/mul chain, float32 RMSNorm in four passes, SiLU times up, the
residual adds — taking more GPU time than the GEMMs. Each kernel here reads its inputs once and
writes its outputs once. `fused(x)` decides per tensor: Triton on CUDA, the torch reference
elsewhere (CPU, or `ENCODER_FUSED=0` to compare): `dispatch.py`. `add_norm` and the activations can
also write their output as FP8 rows (`fp8=True`) for an FP8 GEMM that reads it (`kernels/fp8.py`).
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from encoder.kernels.dispatch import fused, triton
from encoder.kernels.fp8 import Fp8Rows, empty_rows, num_warps_for, rows_reference

if triton is not None:
    import triton.language as tl

    from encoder.kernels.fp8 import _store_fp8_row


# -- residual add + norm -------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _add_norm_kernel(
        x_ptr, r_ptr, w_ptr, b_ptr, sum_ptr, out_ptr, scale_ptr, n_cols, eps,
        HAS_RES: tl.constexpr, RMS: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(r_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
        if RMS:
            var = tl.sum(x * x, axis=0) / n_cols
            y = x * tl.rsqrt(var + eps)
        else:
            mean = tl.sum(x, axis=0) / n_cols
            xc = tl.where(mask, x - mean, 0.0)
            var = tl.sum(xc * xc, axis=0) / n_cols
            y = xc * tl.rsqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * w
        if not RMS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if FP8:  # out: e4m3 [S, D], scale_ptr: [S] float32
            _store_fp8_row(y, out_ptr + row * n_cols, scale_ptr, row, cols, mask)
        else:
            tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """(x + residual, norm(x + residual)): the sum in float32, the norm in the weight's dtype, or with
    `fp8` as e4m3 rows with per-row scales (`Fp8Rows`, quantised from the float32 norm) for an FP8 GEMM.

    RMSNorm when `rms`, else LayerNorm with `bias`. The residual stream stays float32 for the
    whole tower (only GEMM inputs are rounded to the model dtype): in bf16 a 32-block tower
    otherwise loses about 1% to rounding of the stream itself (docs/journal/benchmarks.md).
    """
    # x, residual: [S, D]; either may be float32 or the model dtype
    if not fused(x):
        s = x.float() if residual is None else x.float() + residual.float()
        if rms:
            y = weight.float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))
        else:
            y = F.layer_norm(s, (s.shape[-1],), weight.float(), bias.float(), eps)
        return s, rows_reference(y) if fp8 else y.to(weight.dtype)
    rows, cols = x.shape
    if fp8:
        out = empty_rows(rows, cols, x.device)
        out_ptr, scale_ptr = out.q, out.scale
    else:
        out = out_ptr = torch.empty(rows, cols, dtype=weight.dtype, device=x.device)
        scale_ptr = out_ptr  # not read
    if residual is None and x.dtype != torch.float32:
        x = x.float()
    total = torch.empty(rows, cols, dtype=torch.float32, device=x.device) if residual is not None else x
    _add_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, bias if bias is not None else weight, total, out_ptr,
        scale_ptr, cols, eps, HAS_RES=residual is not None, RMS=rms, FP8=fp8, BLOCK=triton.next_power_of_2(cols),
        num_warps=4 if cols <= 2048 else 8,
    )  # fmt: skip
    return total, out


# -- padding rows ------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _zero_rows_past_kernel(out_ptr, cu_ptr, last, n_rows, row_width, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # blocks of rows below cu[last] (the real rows) exit at once; the others write zeros
        start = tl.program_id(0) * BLOCK_ROWS
        real = tl.load(cu_ptr + last)
        if start + BLOCK_ROWS > real:
            for r in range(BLOCK_ROWS):
                row = start + r
                if row >= real and row < n_rows:
                    for c in range(0, row_width, BLOCK):
                        cols = c + tl.arange(0, BLOCK)
                        ptr = out_ptr + row.to(tl.int64) * row_width + cols
                        tl.store(ptr, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=cols < row_width)


def zero_rows_past(out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Zero the rows of a contiguous `out` [S, ...] at and past cu_seqlens[-1] (bucket padding), read on
    the device. Flash kernels write only rows inside segments, so those rows keep whatever the
    allocator left there (possibly NaN bit patterns), and FA4 reads keys and values past a segment's
    end (masked scores, yet 0 * NaN = NaN): the next layer would leak them into the last image."""
    rows = out.shape[0]
    if not fused(out):
        real = torch.arange(rows, device=out.device) < cu_seqlens[-1].long()
        return out.masked_fill_(~real.view(-1, *([1] * (out.dim() - 1))), 0)
    assert out.is_contiguous(), out.stride()
    width = out.numel() // max(rows, 1)
    _zero_rows_past_kernel[(triton.cdiv(rows, 64),)](
        out, cu_seqlens, cu_seqlens.shape[0] - 1, rows, width, BLOCK_ROWS=64, BLOCK=1024,
    )  # fmt: skip
    return out


# -- rotary on packed qkv ------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rotary_qk_kernel(
        qkv_ptr, cos_ptr, sin_ptr, out_ptr, cu_ptr, last, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HALF_BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr, HAS_OUT: tl.constexpr,
    ):  # fmt: skip
        # one program per token: rotate q and k of every head in place; v is not touched. Rows past
        # cu[last] (padding) also zero their row of the attention output `out` [S, H, D]
        row = tl.program_id(0).to(tl.int64)
        half = HEAD_DIM // 2
        heads = tl.arange(0, HEADS_BLOCK)[:, None]  # a power of two, masked to HEADS (12 heads: 16 lanes)
        cols = tl.arange(0, HALF_BLOCK)[None, :]
        mask = (cols < half) & (heads < HEADS)
        c = tl.load(cos_ptr + row * HEAD_DIM + cols, mask=cols < half, other=0.0)
        s = tl.load(sin_ptr + row * HEAD_DIM + cols, mask=cols < half, other=0.0)
        width = HEADS * HEAD_DIM
        base = qkv_ptr + row * 3 * width + heads * HEAD_DIM + cols
        for which in tl.static_range(2):
            ptr = base + which * width
            a = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptr, (a * c - b * s).to(qkv_ptr.dtype.element_ty), mask=mask)
            tl.store(ptr + half, (b * c + a * s).to(qkv_ptr.dtype.element_ty), mask=mask)
        if HAS_OUT and row >= tl.load(cu_ptr + last):
            dst = out_ptr + row * width + heads * HEAD_DIM + cols
            zero = tl.zeros([HEADS_BLOCK, HALF_BLOCK], dtype=out_ptr.dtype.element_ty)
            tl.store(dst, zero, mask=mask)
            tl.store(dst + half, zero, mask=mask)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, out=None, cu_seqlens=None):
    """Split packed qkv [S, 3*H*D] into q, k, v [S, H, D], q and k rotated.

    With `out` (the attention output buffer [S, H, D], contiguous) and `cu_seqlens`, its padding rows
    (past cu_seqlens[-1]) are zeroed in the same pass: backends write only rows inside segments, and
    the next layer's FA4 reads keys/values past a segment's end, so those rows must not hold an
    allocator's NaN bit patterns (`zero_rows_past`, here at no extra launch).

    cos/sin: [S, D] float32 whose halves are equal (2D rotary duplicates the angle table); the
    rotation is computed in float32 as in the reference. On CUDA q and k are rotated in place and
    all three are strided views of `qkv` (unit stride on the head dim, row stride 3*H*D, which every
    backend accepts): a third less traffic than writing contiguous copies, v never moves.
    """
    rows = qkv.shape[0]
    head_dim = qkv.shape[1] // (3 * heads)
    q, k, v = qkv.view(rows, 3, heads, head_dim).unbind(1)
    if not fused(qkv):

        def rot(x):
            xf = x.float()
            return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)

        if out is not None:
            zero_rows_past(out, cu_seqlens)
        return rot(q), rot(k), v.contiguous()
    assert qkv.is_contiguous(), qkv.stride()
    has_out = out is not None
    assert not has_out or (out.is_contiguous() and out.shape == q.shape), out
    _rotary_qk_kernel[(rows,)](
        qkv, cos, sin, out if has_out else qkv, cu_seqlens if has_out else cos,
        cu_seqlens.shape[0] - 1 if has_out else 0, HEADS=heads, HEAD_DIM=head_dim,
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2), HEADS_BLOCK=triton.next_power_of_2(heads),
        HAS_OUT=has_out, num_warps=4,
    )  # fmt: skip
    return q, k, v


# -- MLP activations -----------------------------------------------------------------------------
SILU_MUL, QUICK_GELU, GELU_TANH = 0, 1, 2  # the activations the kernels know (ACT)

if triton is not None:

    @triton.jit
    def _activate(in_ptr, row, cols, mask, n_cols, ACT: tl.constexpr):
        # one row's activations in float32. SILU_MUL: in is [S, 2F] = [gate | up] -> silu(gate) * up;
        # QUICK_GELU: h * sigmoid(1.702 h); GELU_TANH: 0.5 h (1 + tanh(u)) = h * sigmoid(2u),
        # u = sqrt(2 / pi) (h + 0.044715 h^3). Masked lanes give 0 (every activation has act(0) = 0)
        if ACT == 0:
            g = tl.load(in_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(in_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            y = g * tl.sigmoid(g) * u
        else:
            h = tl.load(in_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if ACT == 1:
                y = h * tl.sigmoid(1.702 * h)
            else:
                y = h * tl.sigmoid(1.5957691216057308 * (h + 0.044715 * h * h * h))
        return y

    @triton.jit
    def _act_kernel(in_ptr, out_ptr, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr):
        # a (row, column block) -> the activation in out's dtype
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _activate(in_ptr, row, cols, mask, n_cols, ACT)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_fp8_kernel(in_ptr, q_ptr, scale_ptr, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr):
        # a whole row (the scale needs its amax) -> e4m3 row and its scale
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _activate(in_ptr, row, cols, mask, n_cols, ACT)
        _store_fp8_row(y, q_ptr + row * n_cols, scale_ptr, row, cols, mask)


def _act_reference(x: torch.Tensor, act: int) -> torch.Tensor:
    # float32, as the kernels compute
    x = x.float()
    if act == SILU_MUL:
        g, u = x.chunk(2, dim=-1)
        return F.silu(g) * u
    if act == QUICK_GELU:
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh")


def _act(x: torch.Tensor, act: int, fp8: bool) -> torch.Tensor | Fp8Rows:
    # x: [S, F] ([S, 2F] for SILU_MUL) -> [S, F] in x's dtype, or Fp8Rows
    rows = x.shape[0]
    f = x.shape[1] // 2 if act == SILU_MUL else x.shape[1]
    if not fused(x):
        y = _act_reference(x, act)
        return rows_reference(y) if fp8 else y.to(x.dtype)
    assert x.is_contiguous(), x.stride()
    if fp8:
        out = empty_rows(rows, f, x.device)
        block = triton.next_power_of_2(f)
        _act_fp8_kernel[(rows,)](x, out.q, out.scale, f, ACT=act, BLOCK=block, num_warps=num_warps_for(block))
        return out
    out = torch.empty(rows, f, dtype=x.dtype, device=x.device)
    _act_kernel[(rows, triton.cdiv(f, 1024))](x, out, f, ACT=act, BLOCK=1024, num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
    """[S, 2F] (gate | up) -> silu(gate) * up, [S, F] (or Fp8Rows with `fp8`)."""
    if not fused(gate_up) and not fp8:  # the reference in the input's dtype, as HF computes it
        g, u = gate_up.split(gate_up.shape[1] // 2, dim=-1)
        return F.silu(g) * u
    return _act(gate_up, SILU_MUL, fp8)


def quick_gelu(h: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
    if not fused(h) and not fp8:
        return h * torch.sigmoid(1.702 * h)
    return _act(h, QUICK_GELU, fp8)


def gelu_tanh(h: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
    """The tanh-approximated GELU, one pass (or Fp8Rows with `fp8`)."""
    if not fused(h) and not fp8:
        return F.gelu(h, approximate="tanh")
    return _act(h, GELU_TANH, fp8)


# -- per-image means ---------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _segment_means_kernel(tok_ptr, cu_ptr, out_ptr, n_cols, divisor, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # one (slot, column block): the slot's rows summed in float32 in row order, over its row count
        slot = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < n_cols
        start = tl.load(cu_ptr + slot).to(tl.int64) // divisor
        end = tl.load(cu_ptr + slot + 1).to(tl.int64) // divisor
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            ptr = tok_ptr + rows[:, None] * n_cols + cols[None, :]
            acc += tl.sum(tl.load(ptr, mask=(rows < end)[:, None] & col_ok[None, :], other=0.0).to(tl.float32), 0)
        tl.store(out_ptr + slot * n_cols + cols, acc / tl.maximum(end - start, 1).to(tl.float32), mask=col_ok)


def segment_means(tokens: torch.Tensor, cu_tokens: torch.Tensor, slots: int, divisor: int = 1) -> torch.Tensor:
    """Per-slot mean of packed tokens, from data: `cu_tokens // divisor` [slots + 1] token boundaries.

    Rows past the last boundary (padding) never reach a mean (a NaN there would otherwise reach every
    mean through 0 * NaN); empty slots get 0. On CUDA one Triton launch summing each slot's rows in row
    order (the reference below took 15 small kernels, 35 µs of a 1x224 replay); the reference is a one-hot
    GEMM ([slots, T] x [T, D]) rather than `index_add_`: deterministic (no atomics) either way.
    """
    # tokens: [T, D]; cu_tokens: [slots + 1] int -> [slots, D] float32
    assert tokens.dim() == 2 and cu_tokens.shape == (slots + 1,), (tokens.shape, cu_tokens.shape)
    if not fused(tokens):
        ends = cu_tokens[1:].long() // divisor
        t = torch.arange(tokens.shape[0], device=tokens.device)
        slot = torch.searchsorted(ends, t, right=True)  # == slots for padding rows
        onehot = (slot[None, :] == torch.arange(slots, device=tokens.device)[:, None]).float()
        real = (slot < slots)[:, None]
        sums = onehot @ torch.where(real, tokens.float(), 0.0)
        counts = (ends - F.pad(ends[:-1], (1, 0))).clamp(min=1)
        return sums / counts[:, None]
    tokens = tokens.contiguous()
    out = torch.empty(slots, tokens.shape[1], dtype=torch.float32, device=tokens.device)
    block_d = 256
    _segment_means_kernel[(slots, triton.cdiv(tokens.shape[1], block_d))](
        tokens, cu_tokens, out, tokens.shape[1], divisor, BLOCK_R=16, BLOCK_D=block_d, num_warps=4
    )
    return out


# -- GEMMs with their neighbours folded in (cuBLAS) -----------------------------------------------
def linear_gelu_tanh(x, linear: torch.nn.Module, fp8: bool = False):
    """gelu_tanh(x @ W.T + b): on CUDA one cuBLASLt GEMM whose epilogue adds the bias and applies the
    tanh-approximated GELU (`torch._addmm_activation`), instead of a GEMM plus a pass over the
    [S, F] hidden activations (3.5 ms of a 94 ms Qwen3-VL-8B forward at 8 x 896², docs/journal/benchmarks.md).
    The CPU kernel of that op applies the exact-erf GELU instead, so everywhere else: the reference."""
    # x: [S, D] (or Fp8Rows) -> [S, F], or Fp8Rows with `fp8` (the next GEMM is an FP8 one)
    # an FP8 layer (`encoder.models.fp8.Fp8Linear`, not an nn.Linear) has no such epilogue: its GEMM, then
    # the GELU kernel, which also quantises for the next FP8 GEMM
    fusable = isinstance(linear, torch.nn.Linear) and linear.bias is not None and not fp8
    if fusable and x.is_cuda and x.dim() == 2 and os.environ.get("ENCODER_FUSED", "1") != "0":
        return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)
    return gelu_tanh(linear(x), fp8=fp8)


# torch.mm(..., out_dtype=) (16-bit inputs, float32 output) exists from torch 2.8 on
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")

if triton is not None:

    @triton.jit
    def _split_hi_lo_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        # one row: out[row] = [hi | lo], hi = x rounded to out's dtype, lo = x - hi rounded again
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        hi = x.to(out_ptr.dtype.element_ty)
        lo = (x - hi.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * 2 * n_cols + cols, hi, mask=mask)
        tl.store(out_ptr + row * 2 * n_cols + n_cols + cols, lo, mask=mask)


_DOUBLED: dict[int, tuple] = {}  # id(weight) -> (weakref, version, [W | W])


def _doubled(weight: torch.Tensor) -> torch.Tensor:
    """[W | W] ([N, 2K]), kept per weight (and its version) so a replay does not rebuild it: a concatenation
    made inside a graph capture is recorded and not kept (its memory belongs to the capture's pool)."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: no version counter, so no cache
        return torch.cat([weight, weight], dim=1)
    hit = _DOUBLED.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == version:
        return hit[2]
    doubled = torch.cat([weight, weight], dim=1)
    if not torch.cuda.is_current_stream_capturing():
        for key in [k for k, v in _DOUBLED.items() if v[0]() is None]:  # weights gone: drop their copies
            del _DOUBLED[key]
        _DOUBLED[id(weight)] = (weakref.ref(weight), version, doubled)
    return doubled


def linear_float32_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ b) in float32 for float32 x and 16-bit W, without rounding x to 16 bits.

    The patch embedding starts the float32 residual stream from float32 pixels. A float32 GEMM
    (no tensor cores) cost 1.9 ms of that same 94 ms forward; here x = hi + lo, both exactly
    representable in W's dtype (|lo| <= 2^-8 |x|, so hi + lo carries 16 bits of x's mantissa), and
    one 16-bit GEMM over [hi | lo] against [W | W] accumulates both in float32 (cuBLAS `out_dtype`).
    Elsewhere (CPU, float32 weights, a torch without `out_dtype`): the float32 GEMM."""
    # x: [S, K] float32, weight: [N, K] -> [S, N] float32
    if x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and _MM_OUT_DTYPE:
        s, kdim = x.shape
        split = torch.empty(s, 2 * kdim, dtype=weight.dtype, device=x.device)
        if fused(x) and x.is_contiguous():
            _split_hi_lo_kernel[(s,)](x, split, kdim, BLOCK=triton.next_power_of_2(kdim), num_warps=4)
        else:
            split[:, :kdim] = x
            torch.sub(x, split[:, :kdim], out=split[:, kdim:])
        y = torch.mm(split, _doubled(weight).t(), out_dtype=torch.float32)
        return y if bias is None else y.add_(bias.float())
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
