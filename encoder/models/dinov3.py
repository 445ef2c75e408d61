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

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.config import Dinov3VisionConfig
from encoder.kernels.elementwise import linear_float32_out
from encoder.models.fp8 import takes_fp8
from encoder.models.layers import (
    FusedQKV,
    LayerScaleBlock,
    PackedAttention,
    activation,
    class_token_outputs,
    prefix_rows,
)
from encoder.models.tower import FixedResolutionTower


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
        registers = (self.register_tokens.float(),) if cfg.num_register_tokens else ()
        return prefix_rows(e.view(n, cfg.num_patches, -1), self.cls_token.float(), *registers)


class Dinov3Attention(PackedAttention):
    """Self-attention with 2D rotary on the patch tokens' queries and keys; `fused()` puts q/k/v in one GEMM
    (`concat_linears`: zeros for the bias-free key)."""

    def __init__(self, cfg: Dinov3VisionConfig):
        super().__init__(cfg.num_heads)
        d = cfg.width
        self.cfg = cfg
        self.q_proj = nn.Linear(d, d, bias=cfg.query_bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.key_bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.value_bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.proj_bias)

    def project_out(self, h: torch.Tensor) -> torch.Tensor:
        return self.o_proj(h)

    def forward(self, x, cu_seqlens, max_seqlen, cos, sin):
        # x: [S, D] packed tokens (model dtype); cos, sin: [L, 1, hd] in the model dtype
        cfg = self.cfg
        q, k, v = self.qkv(x)
        s, heads, hd = v.shape
        prefix = cfg.prefix_tokens
        q, k = (t.view(-1, cfg.seq_len, heads, hd) for t in (q, k))  # [n, T, H, hd]
        q = torch.cat((q[:, :prefix], rotate(q[:, prefix:], cos, sin)), dim=1).view(s, heads, hd)
        k = torch.cat((k[:, :prefix], rotate(k[:, prefix:], cos, sin)), dim=1).view(s, heads, hd)
        return self.attend(q, k, v, cu_seqlens, max_seqlen)

    def fused(self) -> Dinov3FusedAttention:
        return Dinov3FusedAttention(self)


class Dinov3FusedAttention(FusedQKV, Dinov3Attention):
    """`Dinov3Attention` with q, k and v in one GEMM."""


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

    def fused(self, multiple: int) -> Dinov3MLP:
        return self  # its widths are kept


class Dinov3Layer(LayerScaleBlock):
    norms_write_fp8 = False  # its FP8 GEMMs quantise the norms' model-dtype rows themselves

    def __init__(self, cfg: Dinov3VisionConfig):
        super().__init__(cfg.width, cfg.layer_norm_eps, Dinov3Attention(cfg), Dinov3MLP(cfg))


class Dinov3VisionTower(FixedResolutionTower, nn.Module):
    """`DINOv3ViTModel` (see the module docstring); the graph protocol is `FixedResolutionTower`'s."""

    checkpoint_prefixes: tuple[str, ...] = ("",)
    checkpoint_top_level: tuple[str, ...] = ()

    def __init__(self, cfg: Dinov3VisionConfig, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Dinov3Embeddings(cfg)
        self.layer = nn.ModuleList(Dinov3Layer(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.set_backend(backend)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layer

    def forward(self, pixel_values: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_input(pixel_values)
        cos, sin = (t.to(self.norm.weight.dtype).unsqueeze(1) for t in rotary_tables(self.cfg, pixel_values.device))
        x = self.run_blocks(self.embeddings(pixel_values), cu_seqlens, cos, sin)  # [n * T, D] float32
        return class_token_outputs(x, self.norm, self.seq_len, self.cfg.prefix_tokens)
