"""`PatchBatch`: preprocessed images in the packed layout the towers consume."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PatchBatch:
    """Patches of several images, concatenated.

    pixel_values: [total_patches, C*T*P*P] float32, each image's patches in the Hugging Face
        processor's order (merge blocks of m*m patches, row-major over blocks).
    grid_thw: [num_images, 3] int64, (temporal, height, width) in patches per image.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def __post_init__(self):
        assert self.pixel_values.dim() == 2, self.pixel_values.shape
        assert self.grid_thw.dim() == 2 and self.grid_thw.shape[1] == 3, self.grid_thw.shape

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    def patch_counts(self) -> list[int]:
        """Patches per image (t*h*w), host ints."""
        return [int(t * h * w) for t, h, w in self.grid_thw.tolist()]

    def split(self, index: list[int]) -> PatchBatch:
        """The sub-batch of the given image indices, in that order."""
        counts = self.patch_counts()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        parts = [self.pixel_values[starts[i] : starts[i + 1]] for i in index]
        pv = torch.cat(parts) if parts else self.pixel_values[:0]
        return PatchBatch(pv, self.grid_thw[index])

    @staticmethod
    def concat(batches: list[PatchBatch]) -> PatchBatch:
        return PatchBatch(torch.cat([b.pixel_values for b in batches]), torch.cat([b.grid_thw for b in batches]))
