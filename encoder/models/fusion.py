"""Exact inference-only layout changes, built as new modules at load time.

Towers call these from their `fuse()`: each returns a new `nn.Linear` (the old one is dropped by
the caller replacing its submodule), so no live module changes shape or loses attributes.
  * `pad_linear`: zero rows / columns so a GEMM width is a multiple of 128 (Qwen2.5's MLP 3420 ->
    3456, SigLIP's and Qwen3-VL's 4304 -> 4352). Padded hidden units get zero input weights and
    bias, so their activation is act(0) (= 0 for SiLU-gated, GELU and QuickGELU) and they meet zero
    output weights: the result is unchanged.
  * `concat_linears`: one GEMM for several projections of the same input (gate | up, q | k | v).
"""

from __future__ import annotations

import torch
from torch import nn


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple else n


@torch.no_grad()
def pad_linear(linear: nn.Linear, out_features: int | None = None, in_features: int | None = None) -> nn.Linear:
    """A copy of `linear` zero-padded to the given widths."""
    out_f = out_features or linear.out_features
    in_f = in_features or linear.in_features
    w = linear.weight
    new = nn.Linear(in_f, out_f, bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    new.weight.zero_()
    new.weight[: linear.out_features, : linear.in_features].copy_(w)
    if linear.bias is not None:
        new.bias.zero_()
        new.bias[: linear.out_features].copy_(linear.bias)
    return new


@torch.no_grad()
def concat_linears(*linears: nn.Linear) -> nn.Linear:
    """One linear whose output is the concatenation of the given ones' (same input). Where some have a bias
    and others not (DINOv3's bias-free key), those get zeros: the same dot products, plus zero."""
    w = linears[0].weight
    has_bias = any(lin.bias is not None for lin in linears)
    new = nn.Linear(w.shape[1], sum(lin.out_features for lin in linears), bias=has_bias, device=w.device, dtype=w.dtype)
    new.weight.copy_(torch.cat([lin.weight for lin in linears]))
    if has_bias:
        zeros = [w.new_zeros(lin.out_features) for lin in linears]
        new.bias.copy_(torch.cat([z if lin.bias is None else lin.bias for lin, z in zip(linears, zeros, strict=True)]))
    return new


def pad_hidden(fc1: nn.Linear, fc2: nn.Linear, multiple: int) -> tuple[nn.Linear, nn.Linear] | None:
    """An MLP's (in, out) linears with the hidden width between them zero-padded to a multiple; None when
    it is one already (the caller keeps its module), or when they are FP8 layers (`fp8.py`: quantised after
    `fuse()` at load, their widths final)."""
    if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
        return None
    width = round_up(fc1.out_features, multiple)
    if width == fc1.out_features:
        return None
    return pad_linear(fc1, out_features=width), pad_linear(fc2, in_features=width)
