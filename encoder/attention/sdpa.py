"""Reference varlen attention on `torch.nn.functional.scaled_dot_product_attention`.

Works on CPU and GPU in every dtype and is capturable in a CUDA graph: no host reads of
`cu_seqlens`, only index math on the device. Two layouts, both static in shape: a dense [S, S]
block-diagonal mask, or segments scattered into a padded [N, max_seqlen, H, D] batch with a
key-padding mask and gathered back. Either costs memory quadratic in a bound, so this is the
correctness reference and the fallback, not the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder.attention.base import AttentionBackend


class SdpaAttention(AttentionBackend):
    name = "sdpa"
    # the dense layout needs an [S, S] mask; at 32768 tokens SDPA asked for 16 GiB on the H200
    max_graph_tokens = 8192

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        # two static-shape layouts; take the one with fewer score entries. A bound of 0 (every segment
        # empty) is valid: the padded layout keeps one slot per segment so its shapes stay non-empty
        max_seqlen = max(max_seqlen, 1)
        segments = cu_seqlens.numel() - 1
        if q.shape[0] ** 2 <= (segments + 1) * max_seqlen**2:
            return self._dense(q, k, v, cu_seqlens, out)
        return self._padded(q, k, v, cu_seqlens, max_seqlen, out)

    @staticmethod
    def _dense(q, k, v, cu_seqlens, out):
        """One [S, S] block-diagonal mask: cheap when S is small against segments * max_seqlen^2."""
        rows = torch.arange(q.shape[0], device=q.device)
        # padding rows share the out-of-range segment id, so they attend among themselves (finite)
        seg = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
        mask = seg[:, None] == seg[None, :]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        real = (rows < cu_seqlens[-1])[:, None, None]
        out.copy_(torch.where(real, o.transpose(0, 1), torch.zeros_like(q)))
        return out

    @staticmethod
    def _padded(q, k, v, cu_seqlens, max_seqlen, out):
        """Segments scattered into [N + 1, max_seqlen] with a key-padding mask."""
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

        # key j of segment n is valid when j < len(n); empty segments and the spare segment keep
        # one (zero) key so no row is fully masked (a fully masked softmax gives NaN on some kernels)
        lengths = torch.cat([cu[1:] - cu[:-1], cu.new_ones(1)]).clamp(min=1)
        key_ok = torch.arange(max_seqlen, device=q.device)[None, :] < lengths[:, None]
        mask = key_ok[:, None, None, :]  # [N+1, 1, 1, L]
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask)
        o = o.transpose(1, 2).reshape(n_slots, heads, head_dim)
        gathered = o.index_select(0, slot.clamp(max=n_slots - 1))
        out.copy_(torch.where(real[:, None, None], gathered, torch.zeros_like(gathered)))
        return out
