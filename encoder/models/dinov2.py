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
depends on the weights only: `fuse()` (the load-time layout changes a `GraphEncoder` makes) computes it once,
and the forward reads it; before that each forward computes it. (On CUDA torch's bicubic kernel runs one thread
per output position looping over every channel: 256 threads for 1024 channels, ~1.8 ms of a one-image forward.)

Numerics: the residual stream is float32 (each residual add fused with the LayerNorm after it),
GEMM inputs in the model dtype, layer scale applied to each branch output, the final LayerNorm in
float32.

Outputs of `forward(pixel_values, cu_seqlens)`: (tokens, pooled)
  * tokens: [n * L, width] the patch tokens of HF's `last_hidden_state` (after `layernorm`; class and
    register tokens excluded), model dtype;
  * pooled: [n, width] float32, HF's `pooler_output` (the normed class token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.config import Dinov2VisionConfig
from encoder.kernels.elementwise import linear_float32_out
from encoder.models.fp8 import takes_fp8
from encoder.models.layers import (
    MLP,
    FusedQKV,
    LayerScaleBlock,
    PackedAttention,
    class_token_outputs,
    prefix_rows,
)
from encoder.models.tower import FixedResolutionTower


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
        # `patch_positions()` computed once (`freeze_positions`); a plain attribute, not a buffer: no state-dict
        # entry, and no dtype change when the module is cast (it stays float32, as computed)
        self.frozen_positions: torch.Tensor | None = None

    def freeze_positions(self) -> None:
        """Compute the resized position rows now, once; the forward then reads them (the weights are final)."""
        self.frozen_positions = None
        with torch.no_grad():
            self.frozen_positions = self.patch_positions()

    def patch_positions(self) -> torch.Tensor:
        """[L, D] float32: the table's patch rows resized to the input grid (HF's interpolate_pos_encoding)."""
        cfg = self.cfg
        frozen = self.frozen_positions
        if frozen is not None and frozen.device == self.position_embeddings.device:
            return frozen
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
        cls = self.cls_token.view(-1).float() + self.position_embeddings[0, 0].float()
        registers = (self.register_tokens.float(),) if cfg.num_register_tokens else ()
        return prefix_rows(e.view(n, cfg.num_patches, -1) + self.patch_positions(), cls, *registers)


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


class Dinov2Attention(PackedAttention):
    """Self-attention over packed tokens, named as in the checkpoints (`attention.query`, `output.dense`);
    `fused()` puts q/k/v in one GEMM."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__(num_heads)
        self.attention = Dinov2SelfAttention(dim, qkv_bias)
        self.output = Dinov2SelfOutput(dim)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        a = self.attention
        return a.query, a.key, a.value

    def project_out(self, h: torch.Tensor) -> torch.Tensor:
        return self.output.dense(h)

    def fused(self) -> Dinov2FusedAttention:
        return Dinov2FusedAttention(self)


class Dinov2FusedAttention(FusedQKV, Dinov2Attention):
    """`Dinov2Attention` with q, k and v in one GEMM."""


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


class Dinov2Layer(LayerScaleBlock):
    def __init__(self, cfg: Dinov2VisionConfig):
        d = cfg.width
        mlp = Dinov2SwiGLU(d, cfg.swiglu_dim) if cfg.use_swiglu_ffn else MLP(d, cfg.mlp_dim, cfg.hidden_act)
        super().__init__(d, cfg.layer_norm_eps, Dinov2Attention(d, cfg.num_heads, cfg.qkv_bias), mlp)


class Dinov2Encoder(nn.Module):
    def __init__(self, cfg: Dinov2VisionConfig):
        super().__init__()
        self.layer = nn.ModuleList(Dinov2Layer(cfg) for _ in range(cfg.depth))


class Dinov2VisionTower(FixedResolutionTower, nn.Module):
    """`Dinov2Model` / `Dinov2WithRegistersModel` (see the module docstring); the graph protocol is
    `FixedResolutionTower`'s."""

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

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layer

    def fuse(self, pad_mlp: int = 128) -> None:
        """The shared layout changes, and the resized position rows computed once (exact: the same op, once)."""
        super().fuse(pad_mlp)
        self.embeddings.freeze_positions()

    def forward(self, pixel_values: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_input(pixel_values)
        x = self.run_blocks(self.embeddings(pixel_values), cu_seqlens)  # [n * T, D] float32
        return class_token_outputs(x, self.layernorm, self.seq_len, self.cfg.prefix_tokens)
