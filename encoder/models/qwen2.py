"""Qwen2-VL and Qwen2.5-VL vision towers over packed patches.

Module and parameter names mirror the Hugging Face checkpoints (`blocks.N.attn.qkv`, ...), so
loading is a rename-free copy except the patch embedding, stored here as a linear layer (a
Conv3d whose kernel equals its stride over one patch is a matmul over the flattened patch).
The API is split features -> merge: `forward_features` runs the blocks in the window-permuted
token order, `merge` applies the patch merger and restores the Hugging Face token order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.config import Qwen25VLVisionConfig, VisionConfig, attention_kinds
from encoder.kernels.elementwise import add_norm, linear_float32_out, quick_gelu, silu_mul
from encoder.models.fp8 import takes_fp8
from encoder.models.fusion import concat_linears, pad_hidden, pad_linear, round_up
from encoder.models.geometry import VisionMeta, compute_meta, count_windows
from encoder.models.layers import RMSNorm, VisionAttention, norm_args
from encoder.models.tower import Bounds, TowerOutput, backends_per_kind, frames_dummy, segment_means


class QuickGeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: tuple[nn.Linear, nn.Linear] | None = None):
        super().__init__()
        self.fc1, self.fc2 = layers or (nn.Linear(dim, hidden), nn.Linear(hidden, dim))

    def reads_fp8(self) -> bool:
        return takes_fp8(self.fc1)

    def forward(self, x):
        return self.fc2(quick_gelu(self.fc1(x), fp8=takes_fp8(self.fc2)))

    def fused(self, multiple: int) -> QuickGeluMLP:
        """The same MLP with its hidden width zero-padded to a multiple (exact: act(0) = 0)."""
        pair = pad_hidden(self.fc1, self.fc2, multiple)
        return self if pair is None else QuickGeluMLP(0, 0, layers=pair)


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def reads_fp8(self) -> bool:
        return takes_fp8(self.gate_proj) and takes_fp8(self.up_proj)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused(self, multiple: int) -> FusedSwiGLUMLP:
        """The same MLP as one gate|up GEMM ([2F, D]), F zero-padded to a multiple (exact)."""
        width = round_up(self.gate_proj.out_features, multiple)
        gate, up = (pad_linear(lin, out_features=width) for lin in (self.gate_proj, self.up_proj))
        return FusedSwiGLUMLP(concat_linears(gate, up), pad_linear(self.down_proj, in_features=width))


class FusedSwiGLUMLP(nn.Module):
    """SwiGLU with gate and up in one GEMM; the activation kernel reads both halves."""

    def __init__(self, gate_up: nn.Linear, down_proj: nn.Linear):
        super().__init__()
        self.gate_up, self.down_proj = gate_up, down_proj

    def reads_fp8(self) -> bool:
        return takes_fp8(self.gate_up)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_up(x), fp8=takes_fp8(self.down_proj)))

    def fused(self, multiple: int) -> FusedSwiGLUMLP:
        return self


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
        # h: [S, D] in the model dtype, or Fp8Rows straight from the norm when the next GEMM is FP8
        x, h = add_norm(x, delta, *norm_args(self.norm1), fp8=self.attn.reads_fp8())
        attn = self.attn(h, cu, max_len, meta.cos, meta.sin)
        x, h = add_norm(attn, x, *norm_args(self.norm2), fp8=self.mlp.reads_fp8())
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
        # stream; pixels are not rounded to bf16 (`kernels.linear_float32_out`)
        return linear_float32_out(x.float(), self.proj.weight)


class QwenVisionTower(nn.Module):
    """Qwen2-VL / Qwen2.5-VL tower; implements `encoder.models.tower.GraphTower`."""

    patches_per_image = None  # variable resolution

    def __init__(self, cfg: VisionConfig, backend: AttentionBackend | Mapping[str, AttentionBackend]):
        super().__init__()
        self.cfg = cfg
        self.patch_dim, self.merge_unit = cfg.patch_dim, cfg.merge_unit
        full = set(getattr(cfg, "fullatt_block_indexes", range(cfg.depth)))
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg, i in full) for i in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        # Qwen2.5-VL: window attention except at `fullatt_block_indexes`; Qwen2-VL: full everywhere
        self.attention_kinds = attention_kinds(cfg)
        self.set_backend(backend)

    def set_backend(self, backend: AttentionBackend | Mapping[str, AttentionBackend]) -> None:
        """One backend for every layer, or one per layer kind (`attention_kinds`)."""
        self.backends = backends_per_kind(backend, self.attention_kinds)
        self.backend = self.backends["full"]
        for blk in self.blocks:
            blk.attn.backend = self.backends["full" if blk.full_attention else "window"]

    def transformer_blocks(self) -> nn.ModuleList:
        """The blocks whose linear layers `quantization="fp8"` converts (`encoder.models.fp8`)."""
        return self.blocks

    def fuse(self, pad_mlp: int = 128) -> None:
        """Inference-only layout changes, all exact, as new modules: MLP width zero-padded to a
        multiple of `pad_mlp`, SwiGLU's gate and up in one GEMM. Idempotent."""
        for blk in self.blocks:
            blk.mlp = blk.mlp.fused(pad_mlp)

    # -- the graph protocol (encoder.models.tower) -------------------------------------------------------
    def bucket_bounds(self, budget: int, max_images: int, max_image_patches: int) -> Bounds:
        return Bounds(min(max_image_patches, budget), budget // self.merge_unit)

    def batch_bounds(self, grid: list[list[int]]) -> Bounds:
        return Bounds(max(h * w for _, h, w in grid), count_windows(grid, self.cfg))

    def dummy_frames(self, budget: int, max_images: int, bounds: Bounds) -> torch.Tensor:
        return frames_dummy(budget, max_images, bounds, self.cfg.spatial_merge_size)

    def forward_packed(self, pixel_values: torch.Tensor, frames_hw: torch.Tensor, bounds: Bounds) -> TowerOutput:
        # pixel_values: [S, C*T*P*P]; frames_hw: [F, 2] (zero rows: empty slots; rows past the
        # frames' sum: padding). Geometry from data, so the same ops replay for any split.
        meta = compute_meta(frames_hw, pixel_values.shape[0], self.cfg, bounds.max_seqlen, bounds.window_slots)
        tokens = self(pixel_values, meta)  # [S / mu, out_dim]
        means = segment_means(tokens, meta.cu_seqlens, frames_hw.shape[0], self.merge_unit)
        return TowerOutput(tokens, means)

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
