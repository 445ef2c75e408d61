"""`Workspace`: the static buffers of one bucket, at fixed addresses for the life of its graph."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encoder.geometry import VisionMeta
from workspace.buckets import BucketKey


@dataclass
class Workspace:
    """Inputs the host writes before a replay and outputs it reads after.

    Everything that depends on the images is data in these buffers: the packed patches and the
    per-frame grid. The geometry (`cu_seqlens` full and window, rotary cos/sin, window permutation
    and inverse) is computed inside the graph from `frames_hw` into `meta`, whose tensors are
    allocated during capture and stay at their captured addresses.

    Fixed-resolution towers (CLIP, SigLIP) use the same buffers: a bucket is `max_images` image
    slots of L patches each (budget = max_images * L), `frames_hw` marks the real slots (zero rows
    are empty segments), and the graph also writes `pooled`, the model's own embedding per slot.
    """

    key: BucketKey
    pixel_values: torch.Tensor  # [budget, C*T*P*P] float32 packed patches; rows past the real ones are padding
    frames_hw: torch.Tensor  # [max_images, 2] int64 (h, w) in patches; padding rows are (0, 0)
    max_seqlen: int  # static bound on one image's patches
    window_slots: int  # static number of window segments (empty ones pad)
    tokens: torch.Tensor | None = None  # [budget / mu, out_dim] merger output, written by the graph
    means: torch.Tensor | None = None  # [max_images, out_dim] float32 per-image mean, written by the graph
    pooled: torch.Tensor | None = None  # [max_images, out_dim] float32 model embedding (CLIP / SigLIP only)
    meta: VisionMeta | None = None  # geometry tensors produced inside the graph
    captured_ptrs: dict[str, int] = field(default_factory=dict)

    @classmethod
    def allocate(cls, key: BucketKey, patch_dim: int, max_seqlen: int, merge_unit: int, device) -> Workspace:
        return cls(
            key=key,
            pixel_values=torch.zeros(key.budget, patch_dim, dtype=torch.float32, device=device),
            frames_hw=torch.zeros(key.max_images, 2, dtype=torch.long, device=device),
            max_seqlen=min(max_seqlen, key.budget),
            window_slots=key.budget // merge_unit,
        )

    def input_ptrs(self) -> dict[str, int]:
        return {"pixel_values": self.pixel_values.data_ptr(), "frames_hw": self.frames_hw.data_ptr()}

    def nbytes(self) -> int:
        bufs = [self.pixel_values, self.frames_hw, self.tokens, self.means, self.pooled]
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)
