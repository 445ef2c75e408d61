"""Per-batch geometry of packed images: attention segments, 2D rotary tables, window permutation.

Everything is computed from a small `frames_hw` tensor ([F, 2] patch rows/cols per frame) with a
fixed sequence of tensor ops and no host reads, so the same function serves the eager path and
runs inside a captured CUDA graph where `frames_hw` is a static buffer rewritten per replay.
Padding (rows past the real tokens, frames with h = w = 0) yields empty segments, identity
permutation entries and zero rotary angles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from encoder.config import Qwen25VLVisionConfig, VisionConfig
from encoder.kernels.dispatch import fused
from encoder.kernels.geometry import fused_meta


@dataclass
class VisionMeta:
    """What every block reads besides its input; built once per batch, shared by all layers."""

    cu_seqlens: torch.Tensor  # int32 [F + 1] full-attention segments (one per frame)
    max_seqlen: int  # upper bound on a frame's tokens
    cos: torch.Tensor  # [S, head_dim] float32, in the blocks' (window-permuted) token order
    sin: torch.Tensor  # [S, head_dim] float32
    cu_window: torch.Tensor | None = None  # int32 [W + 1] window segments (Qwen2.5 only)
    max_window: int = 0  # tokens in a full window
    window_index: torch.Tensor | None = None  # int64 [S / mu]: permuted unit k holds source unit [k]
    window_inverse: torch.Tensor | None = None  # int64 [S / mu]: source unit u sits at position [u]

    def segments(self, full_attention: bool) -> tuple[torch.Tensor, int]:
        if full_attention or self.cu_window is None:
            return self.cu_seqlens, self.max_seqlen
        return self.cu_window, self.max_window


def frames_of(grid_thw: torch.Tensor) -> torch.Tensor:
    """[F, 2] (h, w) per frame: an image with t frames is t frames of the same grid."""
    return torch.repeat_interleave(grid_thw[:, 1:], grid_thw[:, 0], dim=0)


def count_windows(grid_thw: list[list[int]], cfg: VisionConfig) -> int:
    """Exact number of attention windows of a batch (host ints; used to size eager buffers)."""
    if not isinstance(cfg, Qwen25VLVisionConfig):
        return 0
    m, n = cfg.spatial_merge_size, cfg.window_units
    return sum(t * -(-(h // m) // n) * -(-(w // m) // n) for t, h, w in grid_thw)


def window_tokens(cfg: VisionConfig) -> int:
    return cfg.window_units**2 * cfg.merge_unit if isinstance(cfg, Qwen25VLVisionConfig) else 0


def rotary_inv_freq(cfg: VisionConfig, device) -> torch.Tensor:
    # each of the two axes gets a quarter of the head: head_dim / 4 frequencies
    half = cfg.head_dim // 2
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _meta_fused(frames_hw: torch.Tensor, total: int, cfg: VisionConfig, max_seqlen: int, window_slots: int):
    key = (frames_hw.device, cfg.head_dim, cfg.rope_theta)
    inv_freq = _INV_FREQ.get(key)
    if inv_freq is None:
        inv_freq = rotary_inv_freq(cfg, frames_hw.device)
        if not (inv_freq.is_cuda and torch.cuda.is_current_stream_capturing()):  # kept unless in a graph pool
            _INV_FREQ[key] = inv_freq
    qwen25 = isinstance(cfg, Qwen25VLVisionConfig)
    assert not qwen25 or window_slots > 0, window_slots
    n = cfg.window_units if qwen25 else 0
    cu, cos, sin, cu_window, index, inverse = fused_meta(
        frames_hw, total, inv_freq, cfg.spatial_merge_size, cfg.head_dim, n, window_slots
    )
    if not qwen25:
        return VisionMeta(cu, max_seqlen, cos, sin)
    return VisionMeta(cu, max_seqlen, cos, sin, cu_window, window_tokens(cfg), index, inverse)


def compute_meta(
    frames_hw: torch.Tensor,
    total: int,
    cfg: VisionConfig,
    max_seqlen: int,
    window_slots: int = 0,
) -> VisionMeta:
    """Geometry for `total` packed tokens whose frames are `frames_hw` ([F, 2] int64, device).

    `window_slots` is the static number of window segments (>= the real count; extra ones are
    empty). Tokens past the frames' sum are padding. On CUDA one Triton launch (`geometry_fused`);
    the torch ops below are its reference.
    """
    if fused(frames_hw):
        return _meta_fused(frames_hw, total, cfg, max_seqlen, window_slots)
    dev = frames_hw.device
    m, mu = cfg.spatial_merge_size, cfg.merge_unit
    h, w = frames_hw[:, 0].long(), frames_hw[:, 1].long()
    ends = (h * w).cumsum(0)
    starts = ends - h * w
    cu_seqlens = F.pad(ends, (1, 0)).to(torch.int32)

    # per token: which frame, and its (row, col) in patches; HF order is merge blocks row-major,
    # m x m patches inside each block
    p = torch.arange(total, device=dev)
    f = torch.searchsorted(ends, p, right=True).clamp(max=frames_hw.shape[0] - 1)
    real = p < ends[-1]
    local = p - starts[f]
    blocks_w = (w[f] // m).clamp(min=1)
    unit, r = local // mu, local % mu
    hpos = torch.where(real, (unit // blocks_w) * m + r // m, 0)
    wpos = torch.where(real, (unit % blocks_w) * m + r % m, 0)
    inv_freq = rotary_inv_freq(cfg, dev)
    freqs = torch.cat([hpos[:, None] * inv_freq, wpos[:, None] * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, head_dim]
    cos, sin = emb.cos(), emb.sin()

    if not isinstance(cfg, Qwen25VLVisionConfig):
        return VisionMeta(cu_seqlens, max_seqlen, cos, sin)

    # window permutation over merge units: windows of n x n units, row-major, each read row-major
    n = cfg.window_units
    units = total // mu
    u_tok = torch.arange(units, device=dev) * mu
    fu, lu, real_u = f[u_tok], local[u_tok] // mu, real[u_tok]
    grid_h, grid_w = (h[fu] // m), (w[fu] // m).clamp(min=1)
    uh, uw = lu // grid_w, lu % grid_w
    wh, wi = uh // n, uw // n
    win_h = torch.clamp(grid_h - wh * n, max=n)
    win_w = torch.clamp(grid_w - wi * n, max=n)
    dest = starts[fu] // mu + wh * n * grid_w + win_h * wi * n + (uh % n) * win_w + (uw % n)
    ar = torch.arange(units, device=dev)
    dest = torch.where(real_u, dest, ar)
    window_index = torch.empty_like(dest).scatter_(0, dest, ar)

    # window boundaries: count window starts in permuted order, size each window by its units
    starts_perm = torch.zeros_like(dest).scatter_(0, dest, (real_u & (uh % n == 0) & (uw % n == 0)).long())
    real_perm = torch.zeros_like(dest).scatter_(0, dest, real_u.long())
    ordinal = (starts_perm.cumsum(0) - 1).clamp(0, max(window_slots - 1, 0))
    sizes = torch.zeros(max(window_slots, 1), dtype=torch.long, device=dev)
    sizes.scatter_add_(0, ordinal, real_perm * mu)
    cu_window = F.pad(sizes[:window_slots].cumsum(0), (1, 0)).to(torch.int32)

    cos = cos.view(units, mu, -1)[window_index].view(total, -1)
    sin = sin.view(units, mu, -1)[window_index].view(total, -1)
    return VisionMeta(cu_seqlens, max_seqlen, cos, sin, cu_window, window_tokens(cfg), window_index, dest)
