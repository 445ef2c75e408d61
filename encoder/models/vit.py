"""CLIP and SigLIP vision towers over packed fixed-resolution images, and SigLIP2 NaFlex over packed images
of any grid (`Siglip2VisionTower`, at the end: variable resolution like the Qwen towers).

Every image is the same number of patches (L = (image_size / patch_size)^2), so a batch of n images
is n * L patch rows, the blocks see n * T tokens (T = L, plus a class token for CLIP), and
attention runs through the project's varlen backends with one segment of T tokens per image. The
segment boundaries are data (`segments(frames_hw)`), never Python values: inside a captured graph
image slots past the real ones become empty segments, exactly as for the Qwen towers.

Parameter names mirror the Hugging Face vision models (`embeddings.patch_embedding`,
`encoder.layers.N.self_attn.q_proj`, `post_layernorm`, `head.attention.in_proj_weight`,
`visual_projection`), so loading is a rename-free copy except the Conv2d patch embedding, kept here
as a linear layer over the flattened patch (a convolution whose kernel equals its stride).

Numerics follow the Qwen towers: the residual stream is float32 for the whole tower (each residual
add fused with the LayerNorm after it), GEMM inputs are in the model dtype, and the small per-image
tails (CLIP's class-token LayerNorm and projection, the SigLIP head's residual and LayerNorm) run in
float32.

Outputs of `forward(pixel_values, cu_seqlens)`: (tokens, pooled)
  * tokens: [n * L, width], the patch tokens of HF's `last_hidden_state` (CLIP: without the class
    token, before `post_layernorm`, float32; SigLIP: after `post_layernorm`, model dtype);
  * pooled: [n, out_dim] float32, the model's own image embedding (CLIP `image_embeds`, SigLIP
    `pooler_output`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.config import ClipVisionConfig, Siglip2VisionConfig, SiglipVisionConfig, VitVisionConfig
from encoder.kernels.elementwise import add_norm, linear_float32_out
from encoder.models.layers import MLP, FusedQKV, PackedAttention, norm_args, prefix_rows
from encoder.models.tower import (
    Bounds,
    FixedResolutionTower,
    FullAttentionTower,
    TowerOutput,
    frames_dummy,
    segment_means,
)


class VitAttention(PackedAttention):
    """Self-attention over packed tokens; q/k/v projections as in HF (`fused()` puts them in one GEMM)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__(num_heads)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def fused(self) -> FusedQKVAttention:
        return FusedQKVAttention(self)


class FusedQKVAttention(FusedQKV, VitAttention):
    """`VitAttention` with q, k and v in one GEMM."""


class VitLayer(nn.Module):
    def __init__(self, cfg: VitVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.self_attn = VitAttention(cfg.width, cfg.num_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg.width, cfg.mlp_dim, cfg.hidden_act)

    def forward(self, x, delta, cu_seqlens, max_seqlen):
        """Pre-norm block on the residual stream x + delta (delta None on the first block); each
        residual add is fused with the norm after it. Returns the new (x, delta)."""
        x, h = add_norm(x, delta, *norm_args(self.layer_norm1), fp8=self.self_attn.reads_fp8())
        attn = self.self_attn(h, cu_seqlens, max_seqlen)
        x, h = add_norm(attn, x, *norm_args(self.layer_norm2), fp8=self.mlp.reads_fp8())
        return x, self.mlp(h)


class VitEncoder(nn.Module):
    def __init__(self, cfg: VitVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VitLayer(cfg) for _ in range(cfg.depth))


class VitEmbeddings(nn.Module):
    def __init__(self, cfg: VitVisionConfig):
        super().__init__()
        self.cfg = cfg
        # a Conv2d [D, C, P, P] in checkpoints (bias in SigLIP only), a linear over C*P*P here
        self.patch_embedding = nn.Linear(cfg.patch_dim, cfg.width, bias=not cfg.has_class_token)
        if cfg.has_class_token:
            self.class_embedding = nn.Parameter(torch.zeros(cfg.width))
        self.position_embedding = nn.Embedding(cfg.seq_len, cfg.width)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [n * L, C*P*P] -> [n * T, D] float32: the start of the float32 residual stream; pixels are
        # not rounded to the model dtype (`kernels.linear_float32_out`)
        cfg = self.cfg
        n = pixel_values.shape[0] // cfg.num_patches
        bias = self.patch_embedding.bias
        e = linear_float32_out(pixel_values.float(), self.patch_embedding.weight, bias)
        pos = self.position_embedding.weight.float()
        if not cfg.has_class_token:
            return (e.view(n, cfg.num_patches, -1) + pos).view(n * cfg.seq_len, -1)
        return prefix_rows(e.view(n, cfg.num_patches, -1) + pos[1:], self.class_embedding.float() + pos[0])


class PoolingAttention(nn.Module):
    """The parameters of `nn.MultiheadAttention` (packed in_proj, out_proj), computed here directly."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, query: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # query: [D] (the probe), tokens: [n, T, D] -> [n, D], all in the model dtype
        n, t, d = tokens.shape
        heads, head_dim = self.num_heads, d // self.num_heads
        w, b = self.in_proj_weight, self.in_proj_bias
        q = F.linear(query.view(1, d), w[:d], b[:d]).view(1, heads, 1, head_dim).expand(n, -1, -1, -1)
        kv = F.linear(tokens, w[d:], b[d:]).view(n, t, 2, heads, head_dim)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [n, H, T, hd]
        # one query per image: images are independent batch entries, so padding slots stay apart
        o = F.scaled_dot_product_attention(q, k, v)  # [n, H, 1, hd]
        return self.out_proj(o.reshape(n, d))


class AttentionPoolingHead(nn.Module):
    """SigLIP's MultiheadAttentionPoolingHead: a learned probe attends over the image's tokens."""

    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.attention = PoolingAttention(cfg.width, cfg.num_heads)
        self.layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg.width, cfg.mlp_dim, cfg.hidden_act)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [n, T, D] model dtype -> [n, D] float32 (residual and norm in float32)
        r = self.attention(self.probe.view(-1), tokens).float()
        ln = self.layernorm
        y = F.layer_norm(r, (r.shape[-1],), ln.weight.float(), ln.bias.float(), ln.eps).to(tokens.dtype)
        return r + self.mlp(y).float()


class VitTower(FixedResolutionTower, nn.Module):
    """Shared body of the CLIP and SigLIP towers (see the module docstring); the graph protocol is
    `FixedResolutionTower`'s."""

    # where the tower's weights sit in a checkpoint: under `vision_model.` (full CLIPModel /
    # SiglipModel, CLIPVisionModelWithProjection, older SiglipVisionModel) or at the top level
    # (SiglipVisionModel / CLIPVisionModel saved by transformers 5)
    checkpoint_prefixes: tuple[str, ...] = ("vision_model.", "")
    # weights outside the vision model in every layout (CLIP's projection)
    checkpoint_top_level: tuple[str, ...] = ()
    attention_name = "self_attn"

    def __init__(self, cfg: VitVisionConfig, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.embeddings = VitEmbeddings(cfg)
        self.encoder = VitEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layers

    def stream_start(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def features(self, pixel_values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """[n * L, C*P*P] patches -> [n * T, D] float32 encoder output (before `post_layernorm`)."""
        self.check_input(pixel_values)
        return self.run_blocks(self.stream_start(self.embeddings(pixel_values)), cu_seqlens)

    def forward(self, pixel_values: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class ClipVisionTower(VitTower):
    """`CLIPVisionModelWithProjection`: tokens are `last_hidden_state[:, 1:]`, pooled is `image_embeds`."""

    checkpoint_top_level = ("visual_projection.weight",)

    def __init__(self, cfg: ClipVisionConfig, backend: AttentionBackend):
        super().__init__(cfg, backend)
        self.pre_layrnorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)  # sic: HF's name
        self.visual_projection = nn.Linear(cfg.width, cfg.projection_dim, bias=False)
        self.set_backend(backend)

    def stream_start(self, x):
        ln = self.pre_layrnorm  # float32, so the stream does not start rounded to the model dtype
        return F.layer_norm(x, (x.shape[-1],), ln.weight.float(), ln.bias.float(), ln.eps)

    def forward(self, pixel_values, cu_seqlens):
        cfg = self.cfg
        x = self.features(pixel_values, cu_seqlens).view(-1, cfg.seq_len, cfg.width)
        tokens = x[:, 1:].reshape(-1, cfg.width)
        ln = self.post_layernorm
        cls = F.layer_norm(x[:, 0], (cfg.width,), ln.weight.float(), ln.bias.float(), ln.eps)
        return tokens, F.linear(cls, self.visual_projection.weight.float())


class SiglipVisionTower(VitTower):
    """`SiglipVisionModel`: tokens are `last_hidden_state` (post-LayerNorm), pooled is `pooler_output`."""

    def __init__(self, cfg: SiglipVisionConfig, backend: AttentionBackend):
        super().__init__(cfg, backend)
        self.head = AttentionPoolingHead(cfg)
        self.set_backend(backend)

    def forward(self, pixel_values, cu_seqlens):
        cfg = self.cfg
        _, tokens = add_norm(self.features(pixel_values, cu_seqlens), None, *norm_args(self.post_layernorm))
        return tokens, self.head(tokens.view(-1, cfg.seq_len, cfg.width))


# -- SigLIP2 NaFlex: variable resolution, packed ----------------------------------------------------------


def packed_slots(frames_hw: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed row (from data): (slot [S] int64, row in its image [S], column [S]); rows past the frames'
    sum (padding) get slot F (one past the last) and position (0, 0)."""
    h, w = frames_hw[:, 0].long(), frames_hw[:, 1].long()
    ends = (h * w).cumsum(0)
    p = torch.arange(total, device=frames_hw.device)
    slot = torch.searchsorted(ends, p, right=True)  # == F for padding rows
    f = slot.clamp(max=frames_hw.shape[0] - 1)
    local = torch.where(slot < frames_hw.shape[0], p - (ends[f] - h[f] * w[f]), 0)
    width = w[f].clamp(min=1)
    return slot, local // width, local % width


def resized_positions(table: torch.Tensor, frames_hw: torch.Tensor, slot, rows, cols) -> torch.Tensor:
    """The learned [G*G, D] position table resized to each row's image grid, as transformers' Siglip2 does
    (`F.interpolate(bilinear, align_corners=False, antialias=True)` written as per-axis weights): [S, D]
    float32. Every row is a weighted sum of the table, its weights the outer product of its row's and
    its column's (computed from data, so a captured graph stays right for any grids)."""
    grid = int(round(table.shape[0] ** 0.5))
    f = slot.clamp(max=frames_hw.shape[0] - 1)
    sizes = frames_hw[f].float().clamp(min=1)  # [S, 2] (h, w) of each row's image
    index = torch.stack([rows, cols], -1).float()  # [S, 2]
    scale = grid / sizes
    support = scale.clamp(min=1)
    center = (index + 0.5) * scale - 0.5
    source = torch.arange(grid, device=table.device, dtype=torch.float32)
    weights = (1 - (source - center[..., None]).abs().div(support[..., None])).clamp(min=0)  # [S, 2, G]
    weights = weights / weights.sum(-1, keepdim=True)
    weights = (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(-2)  # [S, G*G]
    return weights @ table.float()


class PackedPoolingAttention(PoolingAttention):
    """`PoolingAttention` over packed images: the probe attends to each image's rows only (a softmax per
    slot, from data); padding rows and empty slots reach no image's output (empty slots give 0)."""

    def forward(self, query: torch.Tensor, tokens: torch.Tensor, slot: torch.Tensor, slots: int) -> torch.Tensor:
        # query: [D]; tokens: [S, D] model dtype; slot: [S] int64 (slots for padding rows) -> [slots, D]
        s, d = tokens.shape
        heads, head_dim = self.num_heads, d // self.num_heads
        w, b = self.in_proj_weight, self.in_proj_bias
        # padding rows hold whatever the attention left there (backends leave rows past the last segment
        # untouched: a captured graph's pool memory, NaN as likely as not) and the one-hot GEMMs below multiply
        # them by 0, which keeps a NaN: zero them first (`where` takes nothing from the branch it does not pick)
        tokens = torch.where((slot < slots)[:, None], tokens, 0)
        q = F.linear(query.view(1, d), w[:d], b[:d]).float().view(heads, head_dim)
        kv = F.linear(tokens, w[d:], b[d:]).float().view(s, 2, heads, head_dim)
        scores = (kv[:, 0] * q).sum(-1) * head_dim**-0.5  # [S, H] float32
        # softmax per slot: each slot's max (order-free, so deterministic), then sums as one-hot GEMMs
        index = slot[:, None].expand(-1, heads)
        peak = torch.full((slots + 1, heads), float("-inf"), device=scores.device)
        peak = peak.scatter_reduce(0, index, scores, "amax")  # row `slots`: the padding rows'
        e = torch.exp(scores - peak[slot]) * (slot < slots)[:, None]  # [S, H]; padding rows 0
        onehot = (slot[None, :] == torch.arange(slots, device=slot.device)[:, None]).float()  # [slots, S]
        den = (onehot @ e).clamp(min=torch.finfo(torch.float32).tiny)  # [slots, H]; empty slots: 0 / tiny
        num = onehot @ (e[:, :, None] * kv[:, 1]).reshape(s, d)  # [slots, D]
        out = (num.view(slots, heads, head_dim) / den[:, :, None]).view(slots, d)
        return self.out_proj(out.to(tokens.dtype))


class PackedAttentionPoolingHead(AttentionPoolingHead):
    """SigLIP's attention-pooling head, one pooled vector per packed image (`PackedPoolingAttention`)."""

    def __init__(self, cfg: Siglip2VisionConfig):
        super().__init__(cfg)
        self.attention = PackedPoolingAttention(cfg.width, cfg.num_heads)

    def forward(self, tokens: torch.Tensor, slot: torch.Tensor, slots: int) -> torch.Tensor:
        # tokens: [S, D] model dtype, slot [S] -> [slots, D] float32 (residual and norm in float32)
        r = self.attention(self.probe.view(-1), tokens, slot, slots).float()
        ln = self.layernorm
        y = F.layer_norm(r, (r.shape[-1],), ln.weight.float(), ln.bias.float(), ln.eps).to(tokens.dtype)
        return r + self.mlp(y).float()


class Siglip2Embeddings(nn.Module):
    def __init__(self, cfg: Siglip2VisionConfig):
        super().__init__()
        # a linear over the (P, P, C) patch in checkpoints too (transformers' Siglip2)
        self.patch_embedding = nn.Linear(cfg.patch_dim, cfg.width)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.width)


class Siglip2VisionTower(FullAttentionTower, nn.Module):
    """`Siglip2VisionModel` (NaFlex) over packed images of any grid; implements `encoder.models.tower.GraphTower`.

    Images are packed row after row with no padding between them (transformers pads each to
    `max_num_patches` and masks): attention runs per image through the varlen backends (one segment per
    image, `cu_seqlens` from `frames_hw` as for the Qwen towers), the position table is resized to each
    image's grid (`resized_positions`), and the head pools each image's rows (`PackedAttentionPoolingHead`).
    Outputs: tokens [S, D] (HF's `last_hidden_state` rows, after `post_layernorm`, model dtype), per-slot
    means, pooled [F, D] float32 (`pooler_output`)."""

    patches_per_image = None  # variable resolution
    merge_unit = 1
    attention_name = "self_attn"
    checkpoint_prefixes: tuple[str, ...] = ("vision_model.", "")
    checkpoint_top_level: tuple[str, ...] = ()

    def __init__(self, cfg: Siglip2VisionConfig, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.patch_dim = cfg.patch_dim
        self.embeddings = Siglip2Embeddings(cfg)
        self.encoder = VitEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.head = PackedAttentionPoolingHead(cfg)
        self.set_backend(backend)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layers

    # -- the graph protocol (encoder.models.tower) ------------------------------------------------------
    def bucket_bounds(self, budget: int, max_images: int, max_image_patches: int) -> Bounds:
        return Bounds(min(max_image_patches, budget))

    def batch_bounds(self, grid: list[list[int]]) -> Bounds:
        return Bounds(max(h * w for _, h, w in grid))

    def dummy_frames(self, budget: int, max_images: int, bounds: Bounds) -> torch.Tensor:
        return frames_dummy(budget, max_images, bounds, 1)

    def forward_packed(self, pixel_values: torch.Tensor, frames_hw: torch.Tensor, bounds: Bounds) -> TowerOutput:
        # pixel_values: [S, P*P*C]; frames_hw: [F, 2] (zero rows: empty slots; rows past the frames' sum:
        # padding). Everything from data: the same ops replay for any split.
        assert pixel_values.dim() == 2 and pixel_values.shape[1] == self.patch_dim, pixel_values.shape
        s, slots = pixel_values.shape[0], frames_hw.shape[0]
        cu_seqlens = F.pad((frames_hw[:, 0] * frames_hw[:, 1]).cumsum(0), (1, 0)).to(torch.int32)
        slot, rows, cols = packed_slots(frames_hw, s)
        emb = self.embeddings
        x = linear_float32_out(pixel_values.float(), emb.patch_embedding.weight, emb.patch_embedding.bias)
        x = x + resized_positions(emb.position_embedding.weight, frames_hw, slot, rows, cols)  # [S, D] float32
        delta = None
        for layer in self.encoder.layers:
            x, delta = layer(x, delta, cu_seqlens, bounds.max_seqlen)
        _, tokens = add_norm(x, delta, *norm_args(self.post_layernorm))  # [S, D] model dtype
        pooled = self.head(tokens, slot, slots)  # [F, D] float32
        return TowerOutput(tokens, segment_means(tokens, cu_seqlens, slots), pooled)


def build_vit_tower(cfg: VitVisionConfig | Siglip2VisionConfig, backend: AttentionBackend):
    if isinstance(cfg, Siglip2VisionConfig):
        return Siglip2VisionTower(cfg, backend)
    if isinstance(cfg, ClipVisionConfig):
        return ClipVisionTower(cfg, backend)
    if isinstance(cfg, SiglipVisionConfig):
        return SiglipVisionTower(cfg, backend)
    raise TypeError(f"not a CLIP / SigLIP config: {type(cfg).__name__}")
