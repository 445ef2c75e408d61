"""Qwen2-VL and Qwen2.5-VL vision towers over packed patches.

Module and parameter names mirror the Hugging Face checkpoints (`blocks.N.attn.qkv`, ...), so
loading is a rename-free copy except the patch embedding, stored here as a linear layer (a
Conv3d whose kernel equals its stride over one patch is a matmul over the flattened patch).
The API is split features -> merge: `forward_features` runs the blocks in the window-permuted
token order, `merge` applies the patch merger and restores the Hugging Face token order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend
from .config import Qwen25VLVisionConfig, VisionConfig
from .geometry import VisionMeta
from .kernels import add_norm, quick_gelu, rotary_qkv, silu_mul


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

    def forward(self, x, cu_seqlens, max_seqlen, cos, sin):
        # x: [S, D] packed tokens
        s, d = x.shape
        q, k, v = rotary_qkv(self.qkv(x), cos, sin, self.num_heads)  # each [S, H, D/H], contiguous
        out = torch.empty_like(q)
        self.backend(q, k, v, cu_seqlens, max_seqlen, out)
        return self.proj(out.view(s, d))


class QuickGeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(quick_gelu(self.fc1(x)))


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x):
        if hasattr(self, "gate_up"):
            return self.down_proj(silu_mul(self.gate_up(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    @torch.no_grad()
    def fuse_gate_up(self) -> None:
        """One GEMM for gate and up ([2F, D]); the activation kernel reads both halves."""
        gate, up = self.gate_proj, self.up_proj
        self.gate_up = nn.Linear(gate.in_features, 2 * gate.out_features, device=gate.weight.device,
                                 dtype=gate.weight.dtype)  # fmt: skip
        self.gate_up.weight.copy_(torch.cat([gate.weight, up.weight]))
        self.gate_up.bias.copy_(torch.cat([gate.bias, up.bias]))
        del self.gate_proj, self.up_proj


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, full_attention: bool):
        super().__init__()
        qwen25 = isinstance(cfg, Qwen25VLVisionConfig)
        norm = (lambda: RMSNorm(cfg.width)) if qwen25 else (lambda: nn.LayerNorm(cfg.width, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(cfg.width, cfg.num_heads)
        self.mlp = SwiGLUMLP(cfg.width, cfg.mlp_dim) if qwen25 else QuickGeluMLP(cfg.width, cfg.mlp_dim)
        self.full_attention = full_attention

    def forward(self, x, delta, meta: VisionMeta):
        """The residual stream is x + delta (delta None on the first block); each residual add is
        fused with the norm that follows it. Returns the new (x, delta)."""
        cu, max_len = meta.segments(self.full_attention)
        x, h = add_norm(x, delta, *norm_args(self.norm1))
        x, h = add_norm(self.attn(h, cu, max_len, meta.cos, meta.sin), x, *norm_args(self.norm2))
        return x, self.mlp(h)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.hidden = cfg.width * cfg.merge_unit
        qwen25 = isinstance(cfg, Qwen25VLVisionConfig)
        self.ln_q = RMSNorm(cfg.width) if qwen25 else nn.LayerNorm(cfg.width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, cfg.out_dim))

    def forward(self, x):
        # x: [S, D] float32 residual stream -> [S / mu, out_dim]
        _, y = add_norm(x, None, *norm_args(self.ln_q))
        return self.mlp(y.view(-1, self.hidden))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.width, bias=False)

    def forward(self, x):
        # x: [S, C*T*P*P] flattened patches -> [S, D] float32: the start of the float32 residual
        # stream; pixels are not rounded to bf16 (a small GEMM, 1176 -> D)
        return F.linear(x.float(), self.proj.weight.float())


class QwenVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        full = set(getattr(cfg, "fullatt_block_indexes", range(cfg.depth)))
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg, i in full) for i in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.set_backend(backend)

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend
        for blk in self.blocks:
            blk.attn.backend = backend

    @torch.no_grad()
    def pad_mlp_width(self, multiple: int = 128) -> int:
        """Zero-pad every MLP's hidden width up to a multiple (Qwen2.5's 3420 -> 3456).

        Exact: padded units get zero input weights and bias, so their activation is
        act(0) * 0 = 0 (SwiGLU) or act(0) = 0 (QuickGELU), and zero output weights. GEMMs with
        a width that is a multiple of 128 run much faster on tensor cores. Returns the new width.
        """

        def grow(linear: nn.Linear, dim: int, new: int) -> None:
            w = linear.weight
            shape = list(w.shape)
            shape[dim] = new - shape[dim]
            linear.weight = nn.Parameter(torch.cat([w, w.new_zeros(shape)], dim=dim))
            if dim == 0 and linear.bias is not None:
                linear.bias = nn.Parameter(torch.cat([linear.bias, linear.bias.new_zeros(shape[0])]))
            if dim == 0:
                linear.out_features = new
            else:
                linear.in_features = new

        width = self.cfg.mlp_dim
        new = -(-width // multiple) * multiple
        if new == width:
            return width
        for blk in self.blocks:
            mlp = blk.mlp
            assert not hasattr(mlp, "gate_up"), "pad the MLP width before fusing gate and up"
            ins = [mlp.gate_proj, mlp.up_proj] if isinstance(mlp, SwiGLUMLP) else [mlp.fc1]
            out = mlp.down_proj if isinstance(mlp, SwiGLUMLP) else mlp.fc2
            for lin in ins:
                grow(lin, 0, new)
            grow(out, 1, new)
        return new

    def fuse_for_speed(self, pad_mlp: int = 128) -> None:
        """Inference-only layout changes, all exact: MLP width padded, gate and up in one GEMM."""
        fused_already = any(hasattr(blk.mlp, "gate_up") for blk in self.blocks)
        if pad_mlp and not fused_already:
            self.pad_mlp_width(pad_mlp)
        for blk in self.blocks:
            if isinstance(blk.mlp, SwiGLUMLP) and not hasattr(blk.mlp, "gate_up"):
                blk.mlp.fuse_gate_up()

    def forward_features(self, pixel_values: torch.Tensor, meta: VisionMeta) -> torch.Tensor:
        # pixel_values: [S, C*T*P*P] in HF order -> [S, D] block outputs in the blocks' order
        assert pixel_values.shape[1] == self.cfg.patch_dim, pixel_values.shape
        x = self.patch_embed(pixel_values)
        if meta.window_index is not None:
            mu = self.cfg.merge_unit
            x = x.view(-1, mu, x.shape[-1])[meta.window_index].view(x.shape)
        delta = None
        for blk in self.blocks:
            x, delta = blk(x, delta, meta)
        return x + delta  # float32

    def merge(self, x: torch.Tensor, meta: VisionMeta) -> torch.Tensor:
        # x: [S, D] float32 -> [S / mu, out_dim] in HF token order
        y = self.merger(x)
        if meta.window_inverse is not None:
            y = y[meta.window_inverse]
        return y

    def forward(self, pixel_values: torch.Tensor, meta: VisionMeta) -> torch.Tensor:
        return self.merge(self.forward_features(pixel_values, meta), meta)
