"""`Workspace`: the static buffers of one bucket, at fixed addresses for the life of its graph."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encoder.models.tower import Bounds, TowerOutput


@dataclass(frozen=True)
class GraphShape:
    """The frozen key of one captured graph: a bucket's patch budget, its image slots, and the static
    bounds baked into its kernels. A bucket may have several shapes: the attention kernels launch
    work for every slot x `max_seqlen` tile, mostly empty when a few large images use a bucket sized
    for many (8 images in 256 slots) or many small ones use bounds sized for one large (25k tokens)."""

    budget: int
    max_images: int
    bounds: Bounds

    def holds(self, num_images: int, longest: int) -> bool:
        return num_images <= self.max_images and longest <= self.bounds.max_seqlen

    @property
    def launch_cost(self) -> int:
        """Attention tiles launched per head (slots x 128-row query tiles); a pack runs in the cheapest
        shape that holds it."""
        return self.max_images * -(-self.bounds.max_seqlen // 128)


@dataclass
class Workspace:
    """Inputs the host writes before a replay and outputs it reads after.

    Everything that depends on the images is data in these buffers: the packed patches and the
    per-frame grid. Whatever geometry a tower needs (segments, rotary tables, window permutation,
    position interpolation) its body computes from `frames_hw` inside the graph; `bounds` are the
    static sizes baked into the graph (from `GraphTower.bucket_bounds`, part of the graph's key).
    `out` holds the tower's outputs, allocated during capture and kept at their captured addresses.

    Fixed-resolution towers use the same buffers: a bucket is `max_images` image slots of L patches
    each (budget = max_images * L) and `frames_hw` marks the real slots (zero rows are empty).
    """

    key: GraphShape
    pixel_values: torch.Tensor  # [budget, patch_dim] float32 packed patches; rows past the real ones are padding
    frames_hw: torch.Tensor  # [max_images, 2] int64 (h, w) in patches; padding rows are (0, 0)
    out: TowerOutput | None = None  # written by the graph (or the eager body on CPU)
    captured_ptrs: dict[str, int] = field(default_factory=dict)

    @classmethod
    def allocate(cls, key: GraphShape, patch_dim: int, device) -> Workspace:
        return cls(
            key=key,
            pixel_values=torch.zeros(key.budget, patch_dim, dtype=torch.float32, device=device),
            frames_hw=torch.zeros(key.max_images, 2, dtype=torch.long, device=device),
        )

    @property
    def bounds(self) -> Bounds:
        return self.key.bounds

    def input_ptrs(self) -> dict[str, int]:
        return {"pixel_values": self.pixel_values.data_ptr(), "frames_hw": self.frames_hw.data_ptr()}
