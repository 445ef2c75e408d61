"""FP8 on request (`encoder.load(..., quantization="fp8")`): the blocks' linear layers in float8 e4m3.

Made at load time, after the weights and the exact layout changes (`fusion.py`, `tower.fuse()`):
  * weights: float8_e4m3fn [out, in] with one float32 scale per output channel (row amax / 448), so
    each channel uses e4m3's whole range; rows that are all zero (padded hidden units) get a tiny
    scale instead of 0 (0 / 0 would be NaN);
  * activations: quantised per token (row) on the device at every call (no `.item()`, no host read, no
    static calibration), captured into the CUDA graphs as they are: by the kernel that produces them where
    a norm or an MLP activation does (`add_norm(..., fp8=True)`, `silu_mul(..., fp8=True)`: the 16-bit
    activation is never written), else by one Triton pass (`encoder.kernels.fp8.quantize_rows`);
  * the GEMM: `torch._scaled_mm` with row-wise scales (scale_a [M, 1] per token, scale_b [1, N] per
    channel), accumulating in float32, adding the bias and writing bfloat16 in one call (cuBLASLt /
    CUTLASS, sm89 and newer).
Attention, norms, the patch embedding and the mergers stay in the model dtype (bfloat16): the
converter touches the `nn.Linear`s inside the transformer blocks only.

On the CPU `Fp8Linear` runs a reference (dequantise, float32 matmul): tests only; `encoder.load` refuses
fp8 off CUDA. e4m3 keeps 3 mantissa bits: a quantised value is within 2^-4 of itself (relative) when
normal, and within 2^-10 of the scale (absolute) when subnormal (`tests/unit/encoder/models/test_fp8.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from encoder.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, Fp8Rows, quantize_reference, quantize_rows

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_AMAX", "Fp8Linear", "Fp8Rows", "dequantize", "quantize_blocks", "quantize_rows"]
# torch._scaled_mm's FP8 operands: both the reduction width K and the output width N multiples of 16
ALIGN = 16


@torch.no_grad()
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], scale [out] float32): one scale per output channel,
    w ≈ q.float() * scale[:, None]."""
    assert w.dim() == 2, w.shape
    q, scale = quantize_reference(w, w.float().abs().amax(dim=1, keepdim=True))
    return q, scale.view(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values `q` stands for: q * scale (scale [rows, 1] or [1, cols], broadcast)."""
    return q.float() * scale


def takes_fp8(linear: nn.Module) -> bool:
    """Whether this layer reads FP8 rows: its producer (a norm, an activation) then writes them directly."""
    return isinstance(linear, Fp8Linear)


class Fp8Linear(nn.Module):
    """y = x @ W.T + b with W in float8 e4m3 (per-output-channel scales) and x quantised per token at
    each call. Inputs and outputs in the model dtype; `in_features` / `out_features` as `nn.Linear`'s.

    Holds buffers, not parameters: nothing trains them, and `VisionEncoder.dtype` (the first parameter's)
    stays the model dtype. Not an `nn.Linear` on purpose: code that reads `.weight` as a 16-bit matrix
    (the fused GELU epilogue, `fusion.pad_linear`) checks the type and leaves these alone."""

    # Hopper's FP8 tensor cores accumulate in reduced precision unless the kernel promotes partial sums to float32
    # (what `use_fast_accum=False` asks); the fast mode skips that. Off: its quality is not measured
    # (`benchmarks/engine.py --fp8-fast-accum` and `benchmarks/fp8_quality.py --fast-accum` measure it).
    fast_accum = False

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_dtype=torch.bfloat16):
        super().__init__()
        # weight: [N, K] float8_e4m3fn row-major; its .t() is the column-major [K, N] _scaled_mm wants
        # as its second operand. scale: [N] float32. bias: [N] in the output dtype (bf16 on CUDA).
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2, (weight.dtype, weight.shape)
        assert scale.shape == (weight.shape[0],) and scale.dtype == torch.float32, (scale.shape, scale.dtype)
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype  # the model dtype: what FP8 rows come back as
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", scale.view(1, -1).contiguous())  # [1, N]: scale_b
        self.register_buffer("bias", None if bias is None else bias.contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        q, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias, out_dtype=linear.weight.dtype)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        # x: [..., K] in the model dtype, or Fp8Rows [M, K] its producer quantised -> [..., N] in the model dtype
        if isinstance(x, Fp8Rows):
            lead, (xq, x_scale) = x.q.shape[:-1], x
        else:
            lead = x.shape[:-1]
            xq, x_scale = quantize_rows(x.reshape(-1, self.in_features))  # [M, K] e4m3, [M, 1] float32
        assert xq.shape[-1] == self.in_features, (xq.shape, self.in_features)
        out_dtype = self.out_dtype if isinstance(x, Fp8Rows) else x.dtype
        if xq.is_cuda:
            out = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale,
                bias=self.bias,
                out_dtype=out_dtype,
                use_fast_accum=self.fast_accum,
            )
        else:  # the reference: what the GEMM computes, in float32 (tests; load refuses fp8 on the CPU)
            out = dequantize(xq, x_scale) @ dequantize(self.weight, self.weight_scale.t()).t()
            if self.bias is not None:
                out = out + self.bias.float()
            out = out.to(out_dtype)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def quantizable(linear: nn.Linear) -> bool:
    """Whether `_scaled_mm` takes this layer's shapes (K and N multiples of 16)."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


# the roles of a fused block's four linear layers, in their order in the block (qkv, attention output, MLP in, out)
ROLES = ("qkv", "proj", "mlp_in", "mlp_out")


@torch.no_grad()
def quantize_blocks(blocks: Iterable[nn.Module], keep: Callable[[int, int, str], bool] | None = None) -> list[str]:
    """Every `nn.Linear` inside the given transformer blocks replaced by an `Fp8Linear`, in place (each
    block's submodule swapped; the old module dropped). Returns the converted layers' names relative to
    the blocks' list ("0.attn.qkv", ...). A layer `_scaled_mm` cannot take (a width not a multiple of
    16: no published tower after `fuse()`) stays in the model dtype, and is not named. `keep(block index,
    depth, role)` (a `ROLES` name) keeps a layer in the model dtype where true: for measuring which layers
    FP8 may take (`benchmarks/fp8_quality.py --keep`); `encoder.load` converts them all."""
    blocks = list(blocks)
    converted = []
    for i, block in enumerate(blocks):
        linears = [(name, mod) for name, mod in block.named_modules() if type(mod) is nn.Linear]
        roles = ROLES if len(linears) == len(ROLES) else (None,) * len(linears)
        targets = [
            (name, mod)
            for (name, mod), role in zip(linears, roles, strict=True)
            if quantizable(mod) and not (keep is not None and keep(i, len(blocks), role))
        ]
        for name, linear in targets:
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, child, Fp8Linear.from_linear(linear))
            converted.append(f"{i}.{name}")
    return converted
