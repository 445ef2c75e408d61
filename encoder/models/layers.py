"""Layers the towers share: RMSNorm, the rotary QKV attention of the Qwen towers, activations by name; for
the plain ViTs (CLIP, SigLIP, SigLIP2, DINOv2, DINOv3) the packed self-attention and its fused-QKV form, the
MLP, the layer-scaled block of the DINO towers, and the class- and register-token rows.

A tower imports these, never another tower (`tests/unit/test_architecture.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.kernels.elementwise import add_norm, gelu_tanh, linear_gelu_tanh, quick_gelu, rotary_qkv
from encoder.models.fp8 import takes_fp8
from encoder.models.fusion import concat_linears, pad_hidden


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


class PackedAttention(nn.Module):
    """Self-attention over packed tokens through the varlen backend (one segment per image in `cu_seqlens`).

    A tower's subclass holds the projections under its checkpoints' names: `projections()` gives q, k and
    v (default `q_proj`, `k_proj`, `v_proj`), `project_out` applies the output one (default `out_proj`);
    `fused()` gives the same attention with q, k and v in one GEMM (`FusedQKV`)."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.backend: AttentionBackend | None = None  # set by the tower

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.q_proj, self.k_proj, self.v_proj

    def project_out(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_proj(h)

    def reads_fp8(self) -> bool:
        return all(takes_fp8(p) for p in self.projections())

    def qkv(self, x: torch.Tensor):
        s, d = x.shape
        heads = self.num_heads
        return (proj(x).view(s, heads, d // heads) for proj in self.projections())

    def attend(self, q, k, v, cu_seqlens, max_seqlen) -> torch.Tensor:
        """The backend over q, k, v [S, H, hd], then the output projection: [S, D]."""
        s, heads, head_dim = v.shape
        out = torch.empty(s, heads, head_dim, dtype=v.dtype, device=v.device)
        self.backend(q, k, v, cu_seqlens, max_seqlen, out)
        return self.project_out(out.view(s, heads * head_dim))

    def forward(self, x, cu_seqlens, max_seqlen):
        # x: [S, D] packed tokens in the model dtype (or Fp8Rows when the q/k/v GEMMs are FP8)
        q, k, v = self.qkv(x)
        return self.attend(q, k, v, cu_seqlens, max_seqlen)

    def fused(self) -> PackedAttention:
        raise NotImplementedError


class FusedQKV:
    """Mixed in before a `PackedAttention` subclass: the same attention with q, k and v in one [3D, D] GEMM
    `qkv_proj` (exact: the same dot products), built from an unfused one. The children holding q, k or v are
    dropped, the others (the output projection) kept after `qkv_proj`: the linear layers in execution order."""

    def __init__(self, like: PackedAttention):
        nn.Module.__init__(self)
        qkv = like.projections()
        self.__dict__.update({k: v for k, v in vars(like).items() if not k.startswith("_")})  # num_heads, backend
        self.qkv_proj = concat_linears(*qkv)
        for name, child in like.named_children():
            if not any(m is p for m in child.modules() for p in qkv):
                setattr(self, name, child)

    def reads_fp8(self) -> bool:
        return takes_fp8(self.qkv_proj)

    def qkv(self, x: torch.Tensor):
        # views with unit stride on the head dim; every backend accepts the other strides
        s, d = x.shape
        return self.qkv_proj(x).view(s, 3, self.num_heads, d // self.num_heads).unbind(1)

    def fused(self):
        return self


class MLP(nn.Module):
    """fc2(act(fc1(x))), named as the CLIP, SigLIP and DINOv2 checkpoints name it."""

    def __init__(self, dim: int, hidden: int, act: str, layers: tuple[nn.Linear, nn.Linear] | None = None):
        super().__init__()
        self.act = act
        self.fc1, self.fc2 = layers or (nn.Linear(dim, hidden), nn.Linear(hidden, dim))

    def reads_fp8(self) -> bool:
        return takes_fp8(self.fc1)

    def forward(self, x):
        fp8 = takes_fp8(self.fc2)  # the activation then writes FP8 rows
        if self.act == "gelu_pytorch_tanh":  # SigLIP: the activation in the fc1 GEMM's epilogue
            return self.fc2(linear_gelu_tanh(x, self.fc1, fp8=fp8))
        return self.fc2(activation(self.fc1(x), self.act, fp8=fp8))

    def fused(self, multiple: int) -> MLP:
        """The same MLP, hidden width zero-padded to a multiple (exact: every activation has act(0) = 0)."""
        pair = pad_hidden(self.fc1, self.fc2, multiple)
        return self if pair is None else MLP(0, 0, self.act, layers=pair)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.ones(dim))


class LayerScaleBlock(nn.Module):
    """The DINOv2 / DINOv3 block, named as their checkpoints: pre-norm (`norm1`, `norm2`), each branch's output
    scaled by layer scale (`layer_scale1`, `layer_scale2`)."""

    # whether the norms write FP8 rows for FP8 q/k/v and MLP GEMMs (else the GEMMs quantise model-dtype rows)
    norms_write_fp8 = True

    def __init__(self, width: int, eps: float, attention: PackedAttention, mlp: nn.Module):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=eps)
        self.attention = attention
        self.layer_scale1 = LayerScale(width)
        self.norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = mlp
        self.layer_scale2 = LayerScale(width)

    def forward(self, x, delta, cu_seqlens, max_seqlen, *position):
        """On the residual stream x + delta (delta None on the first block); each residual add fused with the
        norm after it; `position`: what the attention takes besides (DINOv3's rotary tables). Returns the new
        (x, delta)."""
        fp8 = self.norms_write_fp8
        x, h = add_norm(x, delta, *norm_args(self.norm1), fp8=fp8 and self.attention.reads_fp8())
        attn = self.attention(h, cu_seqlens, max_seqlen, *position) * self.layer_scale1.lambda1
        x, h = add_norm(attn, x, *norm_args(self.norm2), fp8=fp8 and self.mlp.reads_fp8())
        return x, self.mlp(h) * self.layer_scale2.lambda1


def prefix_rows(patches: torch.Tensor, *prefix: torch.Tensor) -> torch.Tensor:
    """Each image's token rows inside the blocks: the `prefix` rows (a class token [D], register tokens [R, D])
    then its patch rows. patches [n, L, D] float32 -> [n * T, D] float32, T = prefix rows + L."""
    n, _, d = patches.shape
    rows = [p.view(-1, d) for p in prefix]
    start = sum(r.shape[0] for r in rows)
    out = torch.empty(n, start + patches.shape[1], d, dtype=torch.float32, device=patches.device)
    i = 0
    for r in rows:
        out[:, i : i + r.shape[0]] = r
        i += r.shape[0]
    out[:, start:] = patches
    return out.view(-1, d)


def class_token_outputs(x: torch.Tensor, norm: nn.LayerNorm, seq_len: int, prefix: int):
    """The final LayerNorm in float32 over [n * T, D] float32 rows -> (patch tokens [n * L, D] in the norm's
    dtype, the normed class token [n, D] float32: HF's `pooler_output`); `prefix`: rows before the patches."""
    d = x.shape[-1]
    normed = F.layer_norm(x.view(-1, seq_len, d), (d,), norm.weight.float(), norm.bias.float(), norm.eps)
    return normed[:, prefix:].reshape(-1, d).to(norm.weight.dtype), normed[:, 0]
