"""Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 vision tower over packed patches (the `GraphTower` protocol).

Module and parameter names mirror the Hugging Face checkpoints under `model.visual.`
(`patch_embed.proj`, `pos_embed`, `blocks.N.attn.qkv`, `blocks.N.mlp.linear_fc1`, `merger.norm`,
`deepstack_merger_list.K.linear_fc2`, ...), so loading is a rename-free copy except the Conv3d patch
embedding, kept here as a linear layer over the flattened patch (its kernel equals its stride).

Everything that depends on the images is computed from `frames_hw` ([F, 2] patch rows/cols per
frame) on the device with a fixed sequence of tensor ops: attention segments and the 2D rotary
table (`geometry.compute_meta`) and the bilinear resampling of the learned position table
(`position_taps`). No host reads, so the body is captured into a CUDA graph as it is.

Numerics follow the other towers: the residual stream is float32 from the patch embedding (plus the
float32 position embedding) to the mergers, each residual add fused with the LayerNorm after it;
GEMM inputs are in the model dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.config import Qwen3VLVisionConfig
from encoder.kernels.elementwise import add_norm, linear_float32_out, linear_gelu_tanh
from encoder.models.fp8 import takes_fp8
from encoder.models.fusion import pad_hidden
from encoder.models.geometry import VisionMeta, compute_meta
from encoder.models.layers import VisionAttention, activation, norm_args
from encoder.models.tower import Bounds, TowerOutput, backends_per_kind, frames_dummy, segment_means


def position_taps(frames_hw: torch.Tensor, total: int, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps into the `side` x `side` learned position grid for `total` packed patches.

    The same arithmetic as transformers' `get_vision_interpolation_indices_and_weights` with
    `align_corners=True` (source coordinate `index * (side - 1) / max(size - 1, 1)`, taps floor and
    floor + 1 clamped to the grid, hat weights), patches in merge-block order. Padding patches (past
    the frames' sum) and frames with h = w = 0 get position (0, 0): finite weights, never read back.
    Returns (indices [S, 4] int64, weights [S, 4] float32).
    """
    # frames_hw: [F, 2] int64 on the device
    dev = frames_hw.device
    h, w = frames_hw[:, 0].long(), frames_hw[:, 1].long()
    ends = (h * w).cumsum(0)
    p = torch.arange(total, device=dev)
    f = torch.searchsorted(ends, p, right=True).clamp(max=frames_hw.shape[0] - 1)
    real = p < ends[-1]
    local = p - (ends - h * w)[f]
    blocks_w = (w[f] // merge).clamp(min=1)
    unit, r = local // (merge * merge), local % (merge * merge)
    row = torch.where(real, (unit // blocks_w) * merge + r // merge, 0)
    col = torch.where(real, (unit % blocks_w) * merge + r % merge, 0)
    offsets = torch.arange(2, device=dev)

    def axis(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
        floor = torch.floor(src)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights  # each [S, 2]

    h_taps, h_w = axis(row, h[f])
    w_taps, w_w = axis(col, w[f])
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(total, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(total, 4)
    return indices, weights


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, layers: tuple[nn.Linear, nn.Linear] | None = None):
        super().__init__()
        self.act = act
        self.linear_fc1, self.linear_fc2 = layers or (nn.Linear(dim, hidden), nn.Linear(hidden, dim))

    def reads_fp8(self) -> bool:
        return takes_fp8(self.linear_fc1)

    def forward(self, x):
        fp8 = takes_fp8(self.linear_fc2)  # the activation then writes FP8 rows
        if self.act == "gelu_pytorch_tanh":  # the activation in the fc1 GEMM's epilogue
            return self.linear_fc2(linear_gelu_tanh(x, self.linear_fc1, fp8=fp8))
        return self.linear_fc2(activation(self.linear_fc1(x), self.act, fp8=fp8))

    def fused(self, multiple: int) -> GeluMLP:
        """A new MLP with the hidden width zero-padded to a multiple (self when it is one already).
        Exact: act(0) = 0 for every supported activation (`encoder.models.fusion`)."""
        pair = pad_hidden(self.linear_fc1, self.linear_fc2, multiple)
        return self if pair is None else GeluMLP(0, 0, self.act, layers=pair)


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.attn = VisionAttention(cfg.width, cfg.num_heads)
        self.mlp = GeluMLP(cfg.width, cfg.mlp_dim, cfg.hidden_act)

    def forward(self, x, delta, meta: VisionMeta):
        """The residual stream is x + delta (delta None on the first block); each residual add is
        fused with the norm that follows it. Returns the new (x, delta)."""
        x, h = add_norm(x, delta, *norm_args(self.norm1), fp8=self.attn.reads_fp8())
        attn = self.attn(h, meta.cu_seqlens, meta.max_seqlen, meta.cos, meta.sin)
        x, h = add_norm(attn, x, *norm_args(self.norm2), fp8=self.mlp.reads_fp8())
        return x, self.mlp(h)


class Qwen3PatchMerger(nn.Module):
    """2x2 merge -> MLP. The final merger normalises each patch (LayerNorm over D) before the merge;
    the DeepStack mergers ("postshuffle") normalise the merged row (LayerNorm over mu * D)."""

    def __init__(self, cfg: Qwen3VLVisionConfig, postshuffle: bool):
        super().__init__()
        self.hidden = cfg.width * cfg.merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else cfg.width, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, cfg.out_dim)

    def forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        # the stream x + delta: [S, D] -> [S / mu, out_dim]; the add is fused with the norm
        if self.postshuffle:
            _, y = add_norm(x.view(-1, self.hidden), delta.reshape(-1, self.hidden), *norm_args(self.norm))
        else:
            _, y = add_norm(x, delta, *norm_args(self.norm))
        # HF's merger GELU is nn.GELU() (exact erf), unlike the blocks' tanh approximation
        return self.linear_fc2(F.gelu(self.linear_fc1(y.view(-1, self.hidden))))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig):
        super().__init__()
        # a Conv3d [D, C, T, P, P] with bias in checkpoints, a linear over C*T*P*P here
        self.proj = nn.Linear(cfg.patch_dim, cfg.width, bias=True)

    def forward(self, x):
        # [S, C*T*P*P] -> [S, D] float32: the start of the float32 residual stream; pixels are not
        # rounded to the model dtype (`kernels.linear_float32_out`)
        return linear_float32_out(x.float(), self.proj.weight, self.proj.bias)


class Qwen3VisionTower(nn.Module):
    """The tower body (`forward_packed`) and what `workspace.GraphRunner` asks of it (`encoder.models.tower`)."""

    patches_per_image = None  # variable resolution: buckets are patch budgets

    def __init__(self, cfg: Qwen3VLVisionConfig, backend: AttentionBackend | Mapping[str, AttentionBackend]):
        super().__init__()
        self.cfg = cfg
        self.patch_dim = cfg.patch_dim
        self.merge_unit = cfg.merge_unit
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.width)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen3PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes
        )
        # block index -> its DeepStack merger (config position k); outputs come in block order, as in transformers
        self.deepstack_at = {b: k for k, b in enumerate(cfg.deepstack_visual_indexes)}
        self.set_backend(backend)

    # -- what the runner reads ---------------------------------------------------------------------
    def bucket_bounds(self, budget: int, max_images: int, max_image_patches: int) -> Bounds:
        return Bounds(max_seqlen=min(max_image_patches, budget))

    def batch_bounds(self, grid: list[list[int]]) -> Bounds:
        # grid: (t, h, w) rows of one batch; every frame is its own attention segment
        return Bounds(max_seqlen=max((h * w for _, h, w in grid), default=1))

    def dummy_frames(self, budget: int, max_images: int, bounds: Bounds) -> torch.Tensor:
        return frames_dummy(budget, max_images, bounds, self.cfg.spatial_merge_size)

    # -- layout changes ---------------------------------------------------------------------------
    attention_kinds = ("full",)  # every block attends over whole images

    def set_backend(self, backend: AttentionBackend | Mapping[str, AttentionBackend]) -> None:
        self.backends = backends_per_kind(backend, self.attention_kinds)
        self.backend = self.backends["full"]
        for blk in self.blocks:
            blk.attn.backend = self.backend

    def transformer_blocks(self) -> nn.ModuleList:
        """The blocks whose linear layers `quantization="fp8"` converts (`encoder.models.fp8`)."""
        return self.blocks

    @torch.no_grad()
    def fuse(self, pad_mlp: int = 128) -> None:
        """Inference-only exact layout change: every block's MLP rebuilt with its hidden width
        zero-padded to a multiple of `pad_mlp` (4304 -> 4352); GEMMs whose width is a multiple of
        128 run much faster on tensor cores. Idempotent; `pad_mlp=0` changes nothing."""
        for blk in self.blocks:
            blk.mlp = blk.mlp.fused(pad_mlp)

    # -- forward ----------------------------------------------------------------------------------
    def position_embedding(self, frames_hw: torch.Tensor, total: int) -> torch.Tensor:
        """[S, D] float32: the learned table resampled to each frame's grid (weighted sum of 4 rows)."""
        idx, weights = position_taps(frames_hw, total, self.cfg.spatial_merge_size, self.cfg.num_grid_per_side)
        # one gather-and-weighted-sum kernel, no [S, 4, D] intermediate (600 MB at 32k patches)
        return F.embedding_bag(idx, self.pos_embed.weight.float(), per_sample_weights=weights, mode="sum")

    def forward_packed(self, pixel_values: torch.Tensor, frames_hw: torch.Tensor, bounds: Bounds) -> TowerOutput:
        """pixel_values [S, C*T*P*P] (HF order; rows past the frames are padding), frames_hw [F, 2]
        int64 (zero rows are empty slots) -> tokens [S / mu, out_dim] in the model dtype, per-slot
        float32 means [F, out_dim], DeepStack features (each [S / mu, out_dim], in block order)."""
        cfg = self.cfg
        total = pixel_values.shape[0]
        assert pixel_values.dim() == 2 and pixel_values.shape[1] == cfg.patch_dim, pixel_values.shape
        assert total % cfg.merge_unit == 0, total
        meta = compute_meta(frames_hw, total, cfg, bounds.max_seqlen)
        x = self.patch_embed(pixel_values) + self.position_embedding(frames_hw, total)
        delta, deepstack = None, []
        for i, blk in enumerate(self.blocks):
            x, delta = blk(x, delta, meta)
            if i in self.deepstack_at:
                deepstack.append(self.deepstack_merger_list[self.deepstack_at[i]](x, delta))
        tokens = self.merger(x, delta)
        means = segment_means(tokens, meta.cu_seqlens, frames_hw.shape[0], cfg.merge_unit)
        return TowerOutput(tokens=tokens, means=means, deepstack=deepstack)
