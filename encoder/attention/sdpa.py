"""Reference varlen attention on `torch.nn.functional.scaled_dot_product_attention`.

Works on CPU and GPU in every dtype and is capturable in a CUDA graph: segments are scattered into
a padded [N, max_seqlen, H, D] batch with index math on the device (no host reads of
`cu_seqlens`), attended with a key-padding mask, and gathered back. Memory is N * max_seqlen rows,
so it is the correctness reference and the fallback, not the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend


class SdpaAttention(AttentionBackend):
    name = "sdpa"

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        total, heads, head_dim = q.shape
        num_segments = cu_seqlens.numel() - 1
        cu = cu_seqlens.long()
        rows = torch.arange(total, device=q.device)
        # segment of each row; padding rows (>= cu[-1]) get index num_segments
        seg = torch.searchsorted(cu[1:], rows, right=True)
        real = seg < num_segments
        seg_c = seg.clamp(max=num_segments - 1)
        pos = (rows - cu[seg_c]).clamp(0, max_seqlen - 1)
        # padding rows scatter into a spare segment that is fully masked and never gathered as real
        seg_p = torch.where(real, seg_c, torch.full_like(seg_c, num_segments))
        slot = seg_p * max_seqlen + pos
        n_slots = (num_segments + 1) * max_seqlen

        def pad(x):
            buf = x.new_zeros(n_slots, heads, head_dim)
            buf.index_copy_(0, torch.where(real, slot, torch.full_like(slot, n_slots - 1)), x)
            # [N+1, H, L, D]
            return buf.view(num_segments + 1, max_seqlen, heads, head_dim).transpose(1, 2)

        lengths = torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])
        # key j of segment n is valid when j < len(n); the spare segment keeps one key so no row is
        # fully masked (a fully masked softmax gives NaN on some SDPA kernels)
        lengths = torch.cat([lengths[:-1], lengths.new_ones(1)])
        lengths = lengths.clamp(min=1)
        key_ok = torch.arange(max_seqlen, device=q.device)[None, :] < lengths[:, None]
        mask = key_ok[:, None, None, :]  # [N+1, 1, 1, L]
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask)
        o = o.transpose(1, 2).reshape(n_slots, heads, head_dim)
        gathered = o.index_select(0, slot.clamp(max=n_slots - 1))
        out.copy_(torch.where(real[:, None, None], gathered, torch.zeros_like(gathered)))
        return out
