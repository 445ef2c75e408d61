"""`GraphEncoder`: a `VisionEncoder` whose forward runs through the bucket graphs."""

from __future__ import annotations

import torch

from encoder.api import VisionEncoder, check_pooling
from encoder.patch_batch import PatchBatch
from workspace.buckets import BucketTable, default_table
from workspace.runner import GraphRunner


def max_image_patches(enc: VisionEncoder) -> int:
    """Patches of the largest image preprocessing can produce (max_pixels / patch area)."""
    pp = enc.preprocess_config
    return pp.max_pixels // (pp.patch_size**2)


class GraphEncoder:
    """Same `preprocess` / `encode` as `VisionEncoder`; captures every bucket at construction.

    `buckets`: a `BucketTable`, a spec `BucketTable.parse` accepts ("256,1024", "pow2:256-32768"),
    or None for the default table. On a machine without CUDA the same packing runs eagerly.
    """

    def __init__(self, vision_encoder: VisionEncoder, buckets=None, *, debug: bool = False, pad_mlp: int = 128):
        self.encoder = vision_encoder
        if vision_encoder.device.type == "cuda":
            # exact layout changes (zero-padded MLP width, fused gate/up GEMM) for faster GEMMs;
            # the eager encoder shares the model and stays equal
            vision_encoder.model.fuse_for_speed(pad_mlp)
        limit = max_image_patches(vision_encoder)
        if buckets is None:
            cap = vision_encoder.model.backend.max_graph_tokens
            table = default_table(max_budget=min(32768, cap or 32768))
        elif isinstance(buckets, BucketTable):
            table = buckets
        else:
            table = BucketTable.parse(buckets, granule=vision_encoder.config.merge_unit)
        self.table = table
        self.runner = GraphRunner(vision_encoder.model, table, max_image_patches=limit, debug=debug)

    @property
    def config(self):
        return self.encoder.config

    @property
    def out_dim(self) -> int:
        return self.encoder.out_dim

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    def preprocess(self, images) -> PatchBatch:
        return self.encoder.preprocess(images)

    @torch.inference_mode()
    def encode(self, images, pooling: str = "none") -> list[torch.Tensor]:
        """Per image: merger tokens ("none") or their mean ("mean"), float32 CPU tensors."""
        check_pooling(pooling)
        batch = images if isinstance(images, PatchBatch) else self.preprocess(images)
        if batch.num_images == 0:
            return []
        self.encoder.check_batch(batch)
        tokens, means = self.runner.run(batch.pixel_values, batch.grid_thw)
        if pooling == "mean":
            return list(means.cpu().unbind(0))
        flat = torch.cat(tokens).float().cpu()  # one device-to-host copy
        return list(torch.split(flat, [t.shape[0] for t in tokens]))

    def stats(self) -> dict:
        return self.runner.stats.as_dict()
