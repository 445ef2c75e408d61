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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # variance in float32 like the reference, result back in the input dtype before the scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [S, H, D]; cos/sin: [S, D] float32. Rotation in float32, as the reference does.
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


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
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, d // self.num_heads).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = torch.empty_like(q)
        self.backend(q, k.contiguous(), v.contiguous(), cu_seqlens, max_seqlen, out)
        return self.proj(out.view(s, d))


class QuickGeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, full_attention: bool):
        super().__init__()
        qwen25 = isinstance(cfg, Qwen25VLVisionConfig)
        norm = (lambda: RMSNorm(cfg.width)) if qwen25 else (lambda: nn.LayerNorm(cfg.width, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(cfg.width, cfg.num_heads)
        self.mlp = SwiGLUMLP(cfg.width, cfg.mlp_dim) if qwen25 else QuickGeluMLP(cfg.width, cfg.mlp_dim)
        self.full_attention = full_attention

    def forward(self, x, meta: VisionMeta):
        cu, max_len = meta.segments(self.full_attention)
        x = x + self.attn(self.norm1(x), cu, max_len, meta.cos, meta.sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.hidden = cfg.width * cfg.merge_unit
        qwen25 = isinstance(cfg, Qwen25VLVisionConfig)
        self.ln_q = RMSNorm(cfg.width) if qwen25 else nn.LayerNorm(cfg.width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, cfg.out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.width, bias=False)

    def forward(self, x):
        # x: [S, C*T*P*P] flattened patches (any float dtype) -> [S, D]
        return self.proj(x.to(self.proj.weight.dtype))


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
            ins = [mlp.gate_proj, mlp.up_proj] if isinstance(mlp, SwiGLUMLP) else [mlp.fc1]
            out = mlp.down_proj if isinstance(mlp, SwiGLUMLP) else mlp.fc2
            for lin in ins:
                grow(lin, 0, new)
            grow(out, 1, new)
        return new

    def forward_features(self, pixel_values: torch.Tensor, meta: VisionMeta) -> torch.Tensor:
        # pixel_values: [S, C*T*P*P] in HF order -> [S, D] block outputs in the blocks' order
        assert pixel_values.shape[1] == self.cfg.patch_dim, pixel_values.shape
        x = self.patch_embed(pixel_values)
        if meta.window_index is not None:
            mu = self.cfg.merge_unit
            x = x.view(-1, mu, x.shape[-1])[meta.window_index].view(x.shape)
        for blk in self.blocks:
            x = blk(x, meta)
        return x

    def merge(self, x: torch.Tensor, meta: VisionMeta) -> torch.Tensor:
        # x: [S, D] -> [S / mu, out_dim] in HF token order
        y = self.merger(x)
        if meta.window_inverse is not None:
            y = y[meta.window_inverse]
        return y

    def forward(self, pixel_values: torch.Tensor, meta: VisionMeta) -> torch.Tensor:
        return self.merge(self.forward_features(pixel_values, meta), meta)
