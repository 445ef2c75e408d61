"""The varlen attention contract every backend implements.

Packed layout: the tokens of all sequences (images, or windows of images) are concatenated along
dim 0. `cu_seqlens` holds the segment boundaries. For CUDA-graph replay the runner pads
`cu_seqlens` with its last value, so trailing segments are empty, and the packed tensors may have
rows past `cu_seqlens[-1]` (bucket padding). A backend must

* write `out[i]` for every row inside a segment, attending only within that segment;
* keep padding rows (past `cu_seqlens[-1]`) finite — zero, or leave them untouched;
* never read `cu_seqlens` on the host (no `.item()`/`.tolist()`): it is data inside a graph;
* treat `max_seqlen` as an upper bound on the longest segment, fixed for the life of a graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class AttentionBackend(ABC):
    """One varlen attention implementation; instances are stateless and shareable across layers."""

    #: registry name, e.g. "sdpa"
    name: str = ""
    #: largest bucket budget this backend should be captured at (None: no limit). Backends whose
    #: memory grows quadratically with the bucket declare it, so the default table stays capturable
    max_graph_tokens: int | None = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can run in this process, else why not (missing package, no GPU)."""
        return None

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None when this backend handles the combination, else a reason; checked at model load."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of q over k/v within each segment, scale 1/sqrt(head_dim), written into `out`.

        q, k, v, out: [S, H, D] packed, same dtype and device. cu_seqlens: int32 [N + 1],
        non-decreasing, cu_seqlens[0] == 0, cu_seqlens[-1] <= S. Returns `out`.
        """

    def __call__(self, q, k, v, cu_seqlens, max_seqlen, out):
        # q: [S, H, D] packed tokens; boundary checks stay cheap and host-only (shapes, not data)
        assert q.dim() == 3 and q.shape == k.shape == v.shape == out.shape, (q.shape, k.shape, out.shape)
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1, cu_seqlens.dtype
        return self.forward(q, k, v, cu_seqlens, int(max_seqlen), out)
