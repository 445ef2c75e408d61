"""`PatchBatch`: preprocessed images in the packed layout the towers consume."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encoder.errors import InvalidArgumentError


@dataclass
class PatchBatch:
    """Patches of several images, concatenated.

    pixel_values: [total_patches, C*T*P*P] float32, each image's patches in the Hugging Face
        processor's order (merge blocks of m*m patches, row-major over blocks).
    grid_thw: [num_images, 3] int64, (temporal, height, width) in patches per image; a video's t is its
        temporal patches (frames / temporal_patch_size, rounded up).
    timestamps: None, or per item None (an image, a video without them) or a video's seconds per temporal patch
        (Qwen3-VL's prompt, `encoder.preprocessing.video`).
    second_per_grid_ts: None, or per item None (an image, a Qwen3-VL video) or the seconds one temporal patch of
        a Qwen2/2.5-VL video spans (Qwen2.5-VL's M-RoPE spacing, `VideoPreprocessConfig.second_per_grid`).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    timestamps: list[list[float] | None] | None = None
    second_per_grid_ts: list[float | None] | None = None

    def __post_init__(self):
        # a public type (`encode(PatchBatch(...))`): wrong inputs get an error naming the field, not an
        # AttributeError from `.dim()` or a float grid that fails deep in the geometry
        if not isinstance(self.pixel_values, torch.Tensor):
            raise InvalidArgumentError(
                f"PatchBatch.pixel_values must be a torch.Tensor, not {type(self.pixel_values).__name__}"
            )
        if self.pixel_values.dim() != 2 or not self.pixel_values.is_floating_point():
            raise InvalidArgumentError(
                "PatchBatch.pixel_values must be a 2-D floating-point tensor [patches, C*T*P*P], got "
                f"{self.pixel_values.dtype} of shape {list(self.pixel_values.shape)}"
            )
        if not isinstance(self.grid_thw, torch.Tensor):  # a list of (t, h, w) rows is taken as given
            try:
                self.grid_thw = torch.as_tensor(self.grid_thw, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidArgumentError(
                    f"PatchBatch.grid_thw must be [num_images, 3] integers, not {type(self.grid_thw).__name__}"
                ) from exc
        if self.grid_thw.is_floating_point() or self.grid_thw.is_complex() or self.grid_thw.dtype == torch.bool:
            raise InvalidArgumentError(f"PatchBatch.grid_thw must hold integers, got {self.grid_thw.dtype}")
        if self.grid_thw.dim() != 2 or self.grid_thw.shape[1] != 3:
            raise InvalidArgumentError(
                f"PatchBatch.grid_thw must be [num_images, 3] (t, h, w) rows, got shape {list(self.grid_thw.shape)}"
            )

        for name in ("timestamps", "second_per_grid_ts"):
            per_item = getattr(self, name)
            if per_item is not None and len(per_item) != self.grid_thw.shape[0]:
                raise InvalidArgumentError(
                    f"PatchBatch.{name} has {len(per_item)} entries for {self.grid_thw.shape[0]} grid_thw rows"
                )

    def timestamps_of(self, i: int) -> list[float] | None:
        """Item i's timestamps (None for an image)."""
        return None if self.timestamps is None else self.timestamps[i]

    def second_per_grid_ts_of(self, i: int) -> float | None:
        """Item i's seconds per temporal patch (None for an image and a Qwen3-VL video)."""
        return None if self.second_per_grid_ts is None else self.second_per_grid_ts[i]

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
        stamps = None if self.timestamps is None else [self.timestamps[i] for i in index]
        per_grid = None if self.second_per_grid_ts is None else [self.second_per_grid_ts[i] for i in index]
        return PatchBatch(pv, self.grid_thw[index], stamps, per_grid)

    @staticmethod
    def concat(batches: list[PatchBatch]) -> PatchBatch:
        stamps = per_grid = None
        if any(b.timestamps is not None for b in batches):
            stamps = [b.timestamps_of(i) for b in batches for i in range(b.num_images)]
        if any(b.second_per_grid_ts is not None for b in batches):
            per_grid = [b.second_per_grid_ts_of(i) for b in batches for i in range(b.num_images)]
        return PatchBatch(
            torch.cat([b.pixel_values for b in batches]), torch.cat([b.grid_thw for b in batches]), stamps, per_grid
        )
