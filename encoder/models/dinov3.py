"""DINOv3 ViT tower over packed fixed-resolution images.

Every image is L = (image_size / patch_size)^2 patches; inside the blocks T = 1 + R + L tokens (class
token, R register tokens, patches), one varlen attention segment per image (`segments(frames_hw)`,
from data, as in the other fixed-resolution towers).

Parameter names are those `DINOv3ViTModel.save_pretrained` writes (`embeddings.cls_token`,
`embeddings.patch_embeddings` (a Conv2d there, a linear layer over the flattened patch here),
`layer.N.attention.q_proj`, `layer.N.layer_scale1.lambda1`, `layer.N.mlp.up_proj`, `norm`).

Position: no table; a 2D rotary embedding on the patch tokens' queries and keys (class and register
tokens are not rotated), as transformers computes it: patch-centre coordinates (y, x) in [-1, 1],
angles 2 pi * coord * theta^(-4i / head_dim) for i < head_dim / 4, y angles then x angles, tiled
twice over the head, rotate-half. The tables depend on the grid only: computed on each forward.

Numerics: the float32 residual stream of the other towers, layer scale on each branch output, the
final LayerNorm in float32.

Outputs of `forward(pixel_values, cu_seqlens)`: (tokens, pooled)
  * tokens: [n * L, width], the patch tokens of HF's `last_hidden_state` (after `norm`), model dtype;
  * pooled: [n, width] float32, HF's `pooler_output` (the normed class token).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.config import Dinov3VisionConfig
from encoder.kernels.elementwise import add_norm, linear_float32_out
from encoder.models.fp8 import takes_fp8
from encoder.models.layers import activation, norm_args
from encoder.models.tower import Bounds, TowerOutput, backends_per_kind


def rotary_tables(cfg: Dinov3VisionConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [L, head_dim] float32, for the patch tokens in row-major order."""
    g = cfg.grid
    inv_freq = 1 / cfg.rope_theta ** torch.arange(0, 1, 4 / cfg.head_dim, dtype=torch.float32, device=device)
    centres = torch.arange(0.5, g, dtype=torch.float32, device=device) / g
    coords = torch.stack(torch.meshgrid(centres, centres, indexing="ij"), dim=-1).flatten(0, 1)  # [L, 2] (y, x)
    coords = 2.0 * coords - 1.0
    angles = (2 * math.pi * coords[:, :, None] * inv_freq[None, None, :]).flatten(1, 2).tile(2)  # [L, head_dim]
    return torch.cos(angles), torch.sin(angles)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; x [..., L, H, hd], cos / sin [L, 1, hd] in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Dinov3Embeddings(nn.Module):
    def __init__(self, cfg: Dinov3VisionConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.width
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, d))  # training only; in every checkpoint
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.num_register_tokens, d))
        self.patch_embeddings = nn.Linear(cfg.patch_dim, d)  # a Conv2d [D, C, P, P] in checkpoints

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [n * L, C*P*P] -> [n * T, D] float32: class token, registers, patch embeddings
        cfg = self.cfg
        n = pixel_values.shape[0] // cfg.num_patches
        e = linear_float32_out(pixel_values.float(), self.patch_embeddings.weight, self.patch_embeddings.bias)
        r = cfg.num_register_tokens
        out = torch.empty(n, cfg.seq_len, cfg.width, dtype=torch.float32, device=e.device)
        out[:, 0] = self.cls_token.view(-1).float()
        if r:
            out[:, 1 : 1 + r] = self.register_tokens.view(r, -1).float()
        out[:, 1 + r :] = e.view(n, cfg.num_patches, -1)
        return out.view(n * cfg.seq_len, -1)


class Dinov3Attention(nn.Module):
    def __init__(self, cfg: Dinov3VisionConfig):
        super().__init__()
        d = cfg.width
        self.cfg = cfg
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(d, d, bias=cfg.query_bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.key_bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.value_bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.proj_bias)
        self.backend: AttentionBackend | None = None  # set by the tower

    def reads_fp8(self) -> bool:
        return takes_fp8(self.q_proj) and takes_fp8(self.k_proj) and takes_fp8(self.v_proj)

    def qkv(self, x: torch.Tensor):
        s, d = x.shape
        return (
            proj(x).view(s, self.num_heads, d // self.num_heads) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )

    def forward(self, x, cu_seqlens, max_seqlen, cos, sin):
        # x: [S, D] packed tokens (model dtype); cos, sin: [L, 1, hd] in the model dtype
        cfg = self.cfg
        s, d = x.shape
        heads, hd = self.num_heads, d // self.num_heads
        q, k, v = self.qkv(x)
        prefix = 1 + cfg.num_register_tokens
        q, k = (t.view(-1, cfg.seq_len, heads, hd) for t in (q, k))  # [n, T, H, hd]
        q = torch.cat((q[:, :prefix], rotate(q[:, prefix:], cos, sin)), dim=1).view(s, heads, hd)
        k = torch.cat((k[:, :prefix], rotate(k[:, prefix:], cos, sin)), dim=1).view(s, heads, hd)
        out = torch.empty(s, heads, hd, dtype=v.dtype, device=v.device)
        self.backend(q, k, v, cu_seqlens, max_seqlen, out)
        return self.o_proj(out.view(s, d))

    def fused(self) -> Dinov3FusedAttention:
        return Dinov3FusedAttention(self)


class Dinov3FusedAttention(Dinov3Attention):
    """The same attention with q, k and v in one [3D, D] GEMM; a projection without a bias (DINOv3's key) gets
    zeros (exact: the same dot products, plus zero)."""

    def __init__(self, like: Dinov3Attention):
        nn.Module.__init__(self)
        self.cfg, self.num_heads, self.backend = like.cfg, like.num_heads, like.backend
        parts = (like.q_proj, like.k_proj, like.v_proj)
        w = like.q_proj.weight
        self.qkv_proj = nn.Linear(w.shape[1], 3 * w.shape[0], device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.qkv_proj.weight.copy_(torch.cat([p.weight for p in parts]))
            self.qkv_proj.bias.copy_(torch.cat([p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0])
                                                for p in parts]))  # fmt: skip
        self.o_proj = like.o_proj  # after qkv_proj: the blocks' linear layers in execution order

    def reads_fp8(self) -> bool:
        return takes_fp8(self.qkv_proj)

    def qkv(self, x: torch.Tensor):
        s, d = x.shape
        return self.qkv_proj(x).view(s, 3, self.num_heads, d // self.num_heads).unbind(1)

    def fused(self) -> Dinov3FusedAttention:
        return self


class Dinov3MLP(nn.Module):
    """up / down (plain) or gate / up / down (gated), as transformers names them."""

    def __init__(self, cfg: Dinov3VisionConfig):
        super().__init__()
        d, h, bias = cfg.width, cfg.mlp_dim, cfg.mlp_bias
        self.act = cfg.hidden_act
        self.gated = cfg.use_gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(d, h, bias=bias)
        self.up_proj = nn.Linear(d, h, bias=bias)
        self.down_proj = nn.Linear(h, d, bias=bias)

    def reads_fp8(self) -> bool:
        return takes_fp8(self.up_proj)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        return F.silu(h) if self.act == "silu" else activation(h, self.act)

    def forward(self, x):
        if self.gated:
            return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self._act(self.up_proj(x)))


class Dinov3LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.ones(dim))


class Dinov3Layer(nn.Module):
    def __init__(self, cfg: Dinov3VisionConfig):
        super().__init__()
        d = cfg.width
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attention = Dinov3Attention(cfg)
        self.layer_scale1 = Dinov3LayerScale(d)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = Dinov3MLP(cfg)
        self.layer_scale2 = Dinov3LayerScale(d)

    def forward(self, x, delta, cu_seqlens, max_seqlen, cos, sin):
        """Pre-norm block on the residual stream x + delta; branches scaled by layer scale."""
        x, h = add_norm(x, delta, *norm_args(self.norm1))
        attn = self.attention(h, cu_seqlens, max_seqlen, cos, sin) * self.layer_scale1.lambda1
        x, h = add_norm(attn, x, *norm_args(self.norm2))
        return x, self.mlp(h) * self.layer_scale2.lambda1


class Dinov3VisionTower(nn.Module):
    """`DINOv3ViTModel` (see the module docstring)."""

    checkpoint_prefixes: tuple[str, ...] = ("",)
    checkpoint_top_level: tuple[str, ...] = ()

    def __init__(self, cfg: Dinov3VisionConfig, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Dinov3Embeddings(cfg)
        self.layer = nn.ModuleList(Dinov3Layer(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.set_backend(backend)

    # -- the graph protocol (encoder.models.tower): every image is L patches, one segment of T tokens

    @property
    def patch_dim(self) -> int:
        return self.cfg.patch_dim

    merge_unit = 1

    @property
    def patches_per_image(self) -> int:
        return self.cfg.num_patches

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layer

    def bucket_bounds(self, budget: int, max_images: int, max_image_patches: int) -> Bounds:
        return Bounds(self.seq_len)

    def batch_bounds(self, grid: list[list[int]]) -> Bounds:
        return Bounds(self.seq_len)

    def dummy_frames(self, budget: int, max_images: int, bounds: Bounds) -> torch.Tensor:
        return torch.tensor([self.cfg.grid, self.cfg.grid]).repeat(max_images, 1)

    def segments(self, frames_hw: torch.Tensor) -> torch.Tensor:
        """cu_seqlens [N + 1] int32 for N image slots; zero (h, w) rows are empty segments (from data)."""
        real = (frames_hw[:, 0] * frames_hw[:, 1] > 0).to(torch.int32)
        return F.pad(torch.cumsum(real * self.seq_len, 0), (1, 0)).to(torch.int32)

    def forward_packed(self, pixel_values: torch.Tensor, frames_hw: torch.Tensor, bounds: Bounds) -> TowerOutput:
        tokens, pooled = self(pixel_values, self.segments(frames_hw))  # [n * L, D], [n, D]
        means = tokens.view(frames_hw.shape[0], self.cfg.num_patches, -1).float().mean(1)
        return TowerOutput(tokens, means, pooled)

    # -- layout changes ---------------------------------------------------------------------------
    attention_kinds = ("full",)

    def set_backend(self, backend: AttentionBackend | Mapping[str, AttentionBackend]) -> None:
        self.backends = backends_per_kind(backend, self.attention_kinds)
        self.backend = self.backends["full"]
        for layer in self.layer:
            layer.attention.backend = self.backend

    def transformer_blocks(self) -> nn.ModuleList:
        return self.layer

    def fuse(self, pad_mlp: int = 128) -> None:
        """Exact inference-only layout change: q/k/v in one GEMM (the MLP widths are kept). Idempotent."""
        for layer in self.layer:
            layer.attention = layer.attention.fused()

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, pixel_values: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        assert pixel_values.dim() == 2 and pixel_values.shape[1] == cfg.patch_dim, pixel_values.shape
        assert pixel_values.shape[0] % cfg.num_patches == 0, (pixel_values.shape, cfg.num_patches)
        dtype = self.norm.weight.dtype
        cos, sin = (t.to(dtype).unsqueeze(1) for t in rotary_tables(cfg, pixel_values.device))  # [L, 1, hd]
        x, delta = self.embeddings(pixel_values), None
        for layer in self.layer:
            x, delta = layer(x, delta, cu_seqlens, self.seq_len, cos, sin)
        x = (x + delta.float()).view(-1, cfg.seq_len, cfg.width)
        ln = self.norm
        normed = F.layer_norm(x, (cfg.width,), ln.weight.float(), ln.bias.float(), ln.eps)  # [n, T, D]
        tokens = normed[:, 1 + cfg.num_register_tokens :].reshape(-1, cfg.width).to(dtype)
        return tokens, normed[:, 0]
