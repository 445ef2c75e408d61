"""Per-token (row) FP8 quantisation of activations: one Triton pass on CUDA, a torch reference elsewhere.

An FP8 GEMM (`encoder.models.fp8.Fp8Linear`) takes its input as e4m3 values and one float32 scale per
row. Done with torch ops (abs, amax, divide, clamp, cast: six kernels and two float32 copies of the
activation), quantising cost 2.6x the FP8 GEMMs themselves on the H100 (Qwen2.5-VL-7B, 32 x 224²:
27 ms of a 45 ms forward, docs/journal). Here one program per row reads the row once and writes the
e4m3 row and its scale; the producers of GEMM inputs (`add_norm`, the MLP activations in
`elementwise.py`) call `_store_fp8_row` themselves, so their output is never written in 16 bits at all.

Everything is device-side (no `.item()`): these kernels are captured into the CUDA graphs as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from encoder.kernels.dispatch import fused, triton

if triton is not None:
    import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# amax floor: an all-zero row gets scale 1e-12 / 448 and quantises to zeros (a zero scale would give 0 / 0)
MIN_AMAX = 1e-12


class Fp8Rows(NamedTuple):
    """A GEMM input already quantised per row: values ≈ q.float() * scale."""

    q: torch.Tensor  # [R, K] float8_e4m3fn
    scale: torch.Tensor  # [R, 1] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_reference(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, K] (any float dtype), amax: [R, 1] -> (x / scale in e4m3 [R, K], scale [R, 1] float32)."""
    scale = amax.float().clamp(min=MIN_AMAX) / FP8_MAX
    # the clamp: the row's largest value divided by its scale may round to a hair above 448, and a
    # float32 past e4m3's range casts to NaN (e4m3fn has no infinity)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def rows_reference(y: torch.Tensor) -> Fp8Rows:
    """The torch reference of every quantising kernel here: per-row amax of `y` (float32 values before
    any 16-bit rounding, as the fused kernels see them), then `quantize_reference`."""
    return Fp8Rows(*quantize_reference(y, y.float().abs().amax(dim=-1, keepdim=True)))


if triton is not None:

    @triton.jit
    def _store_fp8_row(y, q_row_ptr, scale_ptr, row, cols, mask):
        # y: one row's float32 values -> its e4m3 values at q_row_ptr + cols, its scale at scale_ptr[row]
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
        scale = tl.maximum(amax, 1e-12) / 448.0  # MIN_AMAX, FP8_MAX
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_row_ptr + cols, q.to(q_row_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        _store_fp8_row(y, q_ptr + row * n_cols, scale_ptr, row, cols, mask)


def empty_rows(rows: int, cols: int, device: torch.device) -> Fp8Rows:
    return Fp8Rows(
        torch.empty(rows, cols, dtype=FP8_DTYPE, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
    )


def num_warps_for(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """x [rows, K] -> Fp8Rows(e4m3 [rows, K], scale [rows, 1] float32), one scale per row (token):
    x ≈ q.float() * scale. Device work only, no host sync: capturable in a CUDA graph."""
    assert x.dim() == 2, x.shape
    if not fused(x):
        return rows_reference(x)
    x = x.contiguous()
    rows, cols = x.shape
    out = empty_rows(rows, cols, x.device)
    block = triton.next_power_of_2(cols)
    _quantize_rows_kernel[(rows,)](x, out.q, out.scale, cols, BLOCK=block, num_warps=num_warps_for(block))
    return out
