"""DINOv2 and DINOv2-with-registers vision towers over packed fixed-resolution images.

Every image is L = (image_size / patch_size)^2 patches; inside the blocks it is T = 1 + R + L tokens
(class token, R register tokens, patches), one varlen attention segment per image, with the segment
boundaries computed from data (`segments(frames_hw)`) as in the CLIP / SigLIP towers.

Parameter names are those of transformers' `Dinov2Model` / `Dinov2WithRegistersModel`
(as `save_pretrained` writes them: `embeddings.cls_token`, `encoder.layer.N.attention.attention.query`,
`attention.output.dense`, `mlp.weights_in` for SwiGLU, `layer_scale1.lambda1`, `layernorm`), so
loading is a copy; the Conv2d patch embedding is a linear layer over the flattened patch here.

The learned position table ((position_image_size / P)^2 rows plus the class row) is resized to the
input grid by bicubic interpolation in float32 exactly as transformers' `interpolate_pos_encoding`
does (antialiased for the with-registers model; skipped when the grids are equal, as there). It
depends on the weights only, so it is computed on each forward (inside the graph on CUDA).

Numerics: the residual stream is float32 (each residual add fused with the LayerNorm after it),
GEMM inputs in the model dtype, layer scale applied to each branch output, the final LayerNorm in
float32.

Outputs of `forward(pixel_values, cu_seqlens)`: (tokens, pooled)
  * tokens: [n * L, width] the patch tokens of HF's `last_hidden_state` (after `layernorm`; class and
    register tokens excluded), model dtype;
  * pooled: [n, width] float32, HF's `pooler_output` (the normed class token).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.config import Dinov2VisionConfig
from encoder.kernels.elementwise import add_norm, linear_float32_out
from encoder.models.fp8 import takes_fp8
from encoder.models.fusion import concat_linears, pad_hidden
from encoder.models.layers import activation, norm_args
from encoder.models.tower import Bounds, TowerOutput, backends_per_kind


class Dinov2PatchEmbeddings(nn.Module):
    def __init__(self, cfg: Dinov2VisionConfig):
        super().__init__()
        self.projection = nn.Linear(cfg.patch_dim, cfg.width)  # a Conv2d [D, C, P, P] in checkpoints


class Dinov2Embeddings(nn.Module):
    def __init__(self, cfg: Dinov2VisionConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.width
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        if cfg.use_mask_token:
            self.mask_token = nn.Parameter(torch.zeros(1, d))  # training only; in every checkpoint
        self.patch_embeddings = Dinov2PatchEmbeddings(cfg)
        self.position_embeddings = nn.Parameter(torch.zeros(1, cfg.position_grid**2 + 1, d))
        if cfg.num_register_tokens:
            self.register_tokens = nn.Parameter(torch.zeros(1, cfg.num_register_tokens, d))

    def patch_positions(self) -> torch.Tensor:
        """[L, D] float32: the table's patch rows resized to the input grid (HF's interpolate_pos_encoding)."""
        cfg = self.cfg
        table = self.position_embeddings[0, 1:].float()  # [G0 * G0, D]
        if cfg.position_grid == cfg.grid:
            return table
        g0, d = cfg.position_grid, cfg.width
        grid = table.reshape(1, g0, g0, d).permute(0, 3, 1, 2)  # [1, D, G0, G0]
        out = F.interpolate(
            grid, size=(cfg.grid, cfg.grid), mode="bicubic", align_corners=False, antialias=cfg.interpolate_antialias
        )
        return out.permute(0, 2, 3, 1).reshape(cfg.num_patches, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [n * L, C*P*P] -> [n * T, D] float32, T = 1 + R + L: class (+ its position), registers (no
        # position), patches (+ positions)
        cfg = self.cfg
        n = pixel_values.shape[0] // cfg.num_patches
        proj = self.patch_embeddings.projection
        e = linear_float32_out(pixel_values.float(), proj.weight, proj.bias)  # [n * L, D]
        r = cfg.num_register_tokens
        out = torch.empty(n, cfg.seq_len, cfg.width, dtype=torch.float32, device=e.device)
        out[:, 0] = self.cls_token.view(-1).float() + self.position_embeddings[0, 0].float()
        if r:
            out[:, 1 : 1 + r] = self.register_tokens.view(r, -1).float()
        out[:, 1 + r :] = e.view(n, cfg.num_patches, -1) + self.patch_positions()
        return out.view(n * cfg.seq_len, -1)


class Dinov2SelfAttention(nn.Module):
    def __init__(self, dim: int, qkv_bias: bool):
        super().__init__()
        self.query = nn.Linear(dim, dim, bias=qkv_bias)
        self.key = nn.Linear(dim, dim, bias=qkv_bias)
        self.value = nn.Linear(dim, dim, bias=qkv_bias)


class Dinov2SelfOutput(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim)


class Dinov2Attention(nn.Module):
    """Self-attention over packed tokens, named as in the checkpoints (`attention.query`, `output.dense`);
    `fused()` puts q/k/v in one GEMM."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.attention = Dinov2SelfAttention(dim, qkv_bias)
        self.output = Dinov2SelfOutput(dim)
        self.backend: AttentionBackend | None = None  # set by the tower

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        a = self.attention
        return a.query, a.key, a.value

    def reads_fp8(self) -> bool:
        return all(takes_fp8(p) for p in self.projections())

    def qkv(self, x: torch.Tensor):
        s, d = x.shape
        heads = self.num_heads
        return (proj(x).view(s, heads, d // heads) for proj in self.projections())

    def forward(self, x, cu_seqlens, max_seqlen):
        # x: [S, D] packed tokens in the model dtype (or Fp8Rows)
        s, d = x.shape
        q, k, v = self.qkv(x)
        out = torch.empty(s, self.num_heads, d // self.num_heads, dtype=q.dtype, device=q.device)
        self.backend(q, k, v, cu_seqlens, max_seqlen, out)
        return self.output.dense(out.view(s, d))

    def fused(self) -> Dinov2FusedAttention:
        return Dinov2FusedAttention(concat_linears(*self.projections()), self)


class Dinov2FusedAttention(Dinov2Attention):
    """The same attention with q, k and v in one [3D, D] GEMM (exact: the same dot products)."""

    def __init__(self, qkv_proj: nn.Linear, like: Dinov2Attention):
        nn.Module.__init__(self)
        self.num_heads, self.backend = like.num_heads, like.backend
        self.qkv_proj, self.output = qkv_proj, like.output

    def reads_fp8(self) -> bool:
        return takes_fp8(self.qkv_proj)

    def qkv(self, x: torch.Tensor):
        s, d = x.shape
        return self.qkv_proj(x).view(s, 3, self.num_heads, d // self.num_heads).unbind(1)

    def fused(self) -> Dinov2FusedAttention:
        return self


class Dinov2MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, layers: tuple[nn.Linear, nn.Linear] | None = None):
        super().__init__()
        self.act = act
        self.fc1, self.fc2 = layers or (nn.Linear(dim, hidden), nn.Linear(hidden, dim))

    def reads_fp8(self) -> bool:
        return takes_fp8(self.fc1)

    def forward(self, x):
        return self.fc2(activation(self.fc1(x), self.act, fp8=takes_fp8(self.fc2)))

    def fused(self, multiple: int) -> Dinov2MLP:
        pair = pad_hidden(self.fc1, self.fc2, multiple)
        return self if pair is None else Dinov2MLP(0, 0, self.act, layers=pair)


class Dinov2SwiGLU(nn.Module):
    """The SwiGLU MLP (giant), as checkpoints store it: weights_out(silu(a) * b), (a, b) = weights_in(x) halves."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.weights_in = nn.Linear(dim, 2 * hidden)
        self.weights_out = nn.Linear(hidden, dim)

    def reads_fp8(self) -> bool:
        return takes_fp8(self.weights_in)

    def forward(self, x):
        a, b = self.weights_in(x).chunk(2, dim=-1)
        return self.weights_out(F.silu(a) * b)

    def fused(self, multiple: int) -> Dinov2SwiGLU:
        return self


class Dinov2LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.ones(dim))


class Dinov2Layer(nn.Module):
    def __init__(self, cfg: Dinov2VisionConfig):
        super().__init__()
        d = cfg.width
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attention = Dinov2Attention(d, cfg.num_heads, cfg.qkv_bias)
        self.layer_scale1 = Dinov2LayerScale(d)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = Dinov2SwiGLU(d, cfg.swiglu_dim) if cfg.use_swiglu_ffn else Dinov2MLP(d, cfg.mlp_dim, cfg.hidden_act)
        self.layer_scale2 = Dinov2LayerScale(d)

    def forward(self, x, delta, cu_seqlens, max_seqlen):
        """Pre-norm block on the residual stream x + delta (delta None on the first block); the
        branches are scaled by layer scale. Returns the new (x, delta)."""
        x, h = add_norm(x, delta, *norm_args(self.norm1), fp8=self.attention.reads_fp8())
        attn = self.attention(h, cu_seqlens, max_seqlen) * self.layer_scale1.lambda1
        x, h = add_norm(attn, x, *norm_args(self.norm2), fp8=self.mlp.reads_fp8())
        return x, self.mlp(h) * self.layer_scale2.lambda1


class Dinov2Encoder(nn.Module):
    def __init__(self, cfg: Dinov2VisionConfig):
        super().__init__()
        self.layer = nn.ModuleList(Dinov2Layer(cfg) for _ in range(cfg.depth))


class Dinov2VisionTower(nn.Module):
    """`Dinov2Model` / `Dinov2WithRegistersModel` (see the module docstring)."""

    # a vision model saved alone (top level), or the backbone of an image classifier
    checkpoint_prefixes: tuple[str, ...] = ("", "dinov2.", "dinov2_with_registers.")
    checkpoint_top_level: tuple[str, ...] = ()

    def __init__(self, cfg: Dinov2VisionConfig, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Dinov2Embeddings(cfg)
        self.encoder = Dinov2Encoder(cfg)
        self.layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
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
        return self.encoder.layer

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
        for layer in self.encoder.layer:
            layer.attention.backend = self.backend

    def transformer_blocks(self) -> nn.ModuleList:
        return self.encoder.layer

    def fuse(self, pad_mlp: int = 128) -> None:
        """Exact inference-only layout changes: MLP width padded to a multiple of `pad_mlp`, q/k/v in one GEMM."""
        for layer in self.encoder.layer:
            layer.mlp = layer.mlp.fused(pad_mlp)
            layer.attention = layer.attention.fused()

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, pixel_values: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        assert pixel_values.dim() == 2 and pixel_values.shape[1] == cfg.patch_dim, pixel_values.shape
        assert pixel_values.shape[0] % cfg.num_patches == 0, (pixel_values.shape, cfg.num_patches)
        x, delta = self.embeddings(pixel_values), None  # [n * T, D] float32
        for layer in self.encoder.layer:
            x, delta = layer(x, delta, cu_seqlens, self.seq_len)
        x = (x + delta.float()).view(-1, cfg.seq_len, cfg.width)
        ln = self.layernorm
        normed = F.layer_norm(x, (cfg.width,), ln.weight.float(), ln.bias.float(), ln.eps)  # [n, T, D]
        tokens = normed[:, 1 + cfg.num_register_tokens :].reshape(-1, cfg.width).to(ln.weight.dtype)
        return tokens, normed[:, 0]
