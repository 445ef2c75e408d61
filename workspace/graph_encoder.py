"""`GraphEncoder`: a `VisionEncoder` whose forward runs through the bucket graphs.

Fixed-resolution towers (CLIP, SigLIP): every image is L patches, so buckets are image counts. The
default table is 1, 2, 4, ..., 256 images (budget n * L patches), capped by the attention backend's
`max_graph_tokens`; a table or spec given in patch budgets (the service's `buckets`, the batch
jobs') is converted: each bucket becomes the whole images it holds (`min(max_images, budget // L)`),
buckets holding none are dropped, and if none is left one single-image bucket is used.
"""

from __future__ import annotations

import torch

from encoder.api import VisionEncoder, l2_normalize, split_pooling
from encoder.patch_batch import PatchBatch
from workspace.buckets import BucketKey, BucketTable, default_table
from workspace.runner import GraphRunner

#: most images one replay of a fixed-resolution tower holds in the default table
MAX_GRAPH_IMAGES = 256


def max_image_patches(enc: VisionEncoder) -> int:
    """Patches of the largest image preprocessing can produce (max_pixels / patch area)."""
    if enc.fixed_resolution:
        return enc.config.num_patches
    pp = enc.preprocess_config
    return pp.max_pixels // (pp.patch_size**2)


def image_count_table(counts, patches_per_image: int) -> BucketTable:
    """Buckets of `counts` images each (budget = n * patches_per_image), for a fixed-resolution tower."""
    return BucketTable(BucketKey(n * patches_per_image, n) for n in sorted(set(counts)))


def fixed_table(patches_per_image: int, buckets=None, max_tokens: int | None = None) -> BucketTable:
    """The image-count table of a fixed-resolution tower (see the module docstring).

    `buckets`: None (powers of two up to `MAX_GRAPH_IMAGES` images, at most `max_tokens` patches per
    replay), a `BucketTable`, a spec `BucketTable.parse` accepts, or a list of (budget, max_images).
    """
    per = patches_per_image
    if buckets is None:
        limit = max(1, min(MAX_GRAPH_IMAGES, (max_tokens or per * MAX_GRAPH_IMAGES) // per))
        counts = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
        return image_count_table([*counts, limit], per)
    if isinstance(buckets, BucketTable):
        table = buckets
    elif isinstance(buckets, list | tuple) and all(isinstance(k, list | tuple) and len(k) == 2 for k in buckets):
        table = BucketTable(BucketKey(b, m) for b, m in buckets)
    else:
        table = BucketTable.parse(buckets)
    counts = {min(k.max_images, k.budget // per) for k in table.keys} - {0}
    return image_count_table(counts or {1}, per)


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
        if vision_encoder.fixed_resolution:
            cap = vision_encoder.model.backend.max_graph_tokens
            table = fixed_table(vision_encoder.config.num_patches, buckets, cap if buckets is None else None)
        elif buckets is None:
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
    def default_pooling(self) -> str:
        return self.encoder.default_pooling

    def output_dim(self, pooling: str | None = None) -> int:
        return self.encoder.output_dim(pooling)

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    def preprocess(self, images) -> PatchBatch:
        return self.encoder.preprocess(images)

    @torch.inference_mode()
    def encode(self, images, pooling: str | None = None) -> list[torch.Tensor]:
        """Per image, float32 CPU tensors, as `VisionEncoder.encode`: tokens ("none"), their mean
        ("mean"), the model's embedding ("model", CLIP / SigLIP), "-l2" for L2-normalised vectors.
        `pooling=None` is the model's default."""
        pooling = self.encoder.resolve_pooling(pooling)
        base, l2 = split_pooling(pooling)
        batch = images if isinstance(images, PatchBatch) else self.preprocess(images)
        if batch.num_images == 0:
            return []
        self.encoder.check_batch(batch)
        out = self.runner.run_all(batch.pixel_values, batch.grid_thw)
        if base == "model":
            outs = list(out.pooled.cpu().unbind(0))
        elif base == "mean":
            outs = list(out.means.cpu().unbind(0))
        else:
            flat = torch.cat(out.tokens).float().cpu()  # one device-to-host copy
            return list(torch.split(flat, [t.shape[0] for t in out.tokens]))
        return l2_normalize(outs) if l2 else outs

    def stats(self) -> dict:
        return self.runner.stats.as_dict()
