"""Which bucket table a process uses: the one resolver (model, attention backend, device, spec).

Every process that needs a table asks here: `GraphEncoder` (hence the runner) for the engine's table,
the Serve replicas and the batch actors for their process's table, the batch driver for the table its
actors will have (to size Ray Data batches), and the request router for its fallback before any replica
published one. So they cannot disagree.

* `TowerShape`: what a table depends on of a model, known without its weights (`shape_of_encoder` for a
  loaded model; the batch driver builds one from the config alone).
* `engine_table(shape, buckets, max_graph_tokens)`: the engine's rule. `buckets` None is the engine
  default: powers of two on the model's 224x224 unit up to `buckets.MAX_BUDGET` patches, capped by the
  attention backend's `max_graph_tokens`; fixed-resolution towers (CLIP, SigLIP) get image-count tables
  (up to `MAX_GRAPH_IMAGES` images, capped by `max_graph_tokens` only).
* `process_plan(shape, device, ...)`: a serving or batch process's table and batch limits: the device's
  defaults (`DEVICE_DEFAULTS`) where the operator gave none, then `engine_table`.

Fixed-resolution towers: every image is L patches, so buckets are image counts. The default table is 1, 2,
4, ..., 256 images (budget n * L patches); a table or spec given in patch budgets (the service's `buckets`,
the batch jobs') is converted: each bucket becomes the whole images it holds (`min(max_images, budget //
L)`), buckets holding none are dropped, and if none is left one single-image bucket is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workspace.buckets import MAX_BUDGET, BucketKey, BucketTable, default_table

#: most images one replay of a fixed-resolution tower holds in the default table
MAX_GRAPH_IMAGES = 256


@dataclass(frozen=True)
class DeviceDefaults:
    """A device's bucket and batch defaults, used where the operator set none."""

    buckets: str | None  # None: the engine default table
    bucket_max_images: int | None  # None: the table's own rule
    max_batch_patches: int | None  # None: the largest bucket's budget
    max_batch_images: int | None  # None: the largest bucket's max_images


DEVICE_DEFAULTS = {
    "cuda": DeviceDefaults(None, None, None, None),
    # On a CPU every bucket runs eagerly with its static (padded) attention bounds, so small buckets holding
    # one image each are far cheaper than the GPU's multi-image graphs (the reference attention's cost grows
    # with the square of the budget); a batch is a few small images, each replayed alone.
    "cpu": DeviceDefaults("256,1024", 1, 8192, 32),
}


@dataclass(frozen=True)
class TowerShape:
    """What the bucket table depends on of a model."""

    merge_unit: int  # budgets are multiples of it (Qwen2.5-VL's window layout: 4)
    unit_patches: int  # patches of one 224x224 image after resizing: the smallest default bucket
    patches_per_image: int | None = None  # towers whose images all have this many patches (image-count tables)


def shape_of_encoder(vision) -> TowerShape:
    """The shape of a loaded `encoder.VisionEncoder`."""
    tower, per = vision.model, vision.model.patches_per_image
    unit = per if per is not None else vision.num_patches(224, 224)
    return TowerShape(tower.merge_unit, unit, per)


def image_count_table(counts, patches_per_image: int) -> BucketTable:
    """Buckets of `counts` images each (budget = n * patches_per_image), for a fixed-resolution tower."""
    return BucketTable(BucketKey(n * patches_per_image, n) for n in sorted(set(counts)))


def _as_table(buckets: Any, granule: int, max_images: int | None) -> BucketTable:
    """A `BucketTable`, a list of (budget, max_images) pairs, or a spec `BucketTable.parse` accepts."""
    if isinstance(buckets, BucketTable):
        return buckets
    if isinstance(buckets, list | tuple) and all(isinstance(k, list | tuple) and len(k) == 2 for k in buckets):
        return BucketTable(BucketKey(b, m) for b, m in buckets)
    return BucketTable.parse(buckets, granule=granule, max_images=max_images)


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
    table = _as_table(buckets, 1, None)
    counts = {min(k.max_images, k.budget // per) for k in table.keys} - {0}
    return image_count_table(counts or {1}, per)


def engine_table(
    shape: TowerShape, buckets: Any = None, max_graph_tokens: int | None = None, max_images: int | None = None
) -> BucketTable:
    """The engine's table for `buckets` (None: the default, at most `max_graph_tokens` patches per replay).

    `max_images` (with a spec, or alone: the default budgets) fixes every bucket's image count.
    """
    cap = min(MAX_BUDGET, max_graph_tokens or MAX_BUDGET)
    if buckets is None and max_images is not None:  # the default budgets with a fixed image count
        if shape.patches_per_image is None:  # on the model's own 224^2 unit (its processor's size), as `default_table`
            default = default_table(max_budget=cap, min_budget=shape.unit_patches)
            return BucketTable(BucketKey(key.budget, max_images) for key in default.keys)
        buckets = f"pow2:256-{1 << (max(256, cap).bit_length() - 1)}"
    if shape.patches_per_image is not None:
        if buckets is None:  # image counts: MAX_GRAPH_IMAGES bounds them, not MAX_BUDGET
            return fixed_table(shape.patches_per_image, None, max_graph_tokens)
        return fixed_table(shape.patches_per_image, _as_table(buckets, shape.merge_unit, max_images))
    if buckets is None:
        return default_table(max_budget=cap, min_budget=shape.unit_patches)
    return _as_table(buckets, shape.merge_unit, max_images)


@dataclass(frozen=True)
class BucketPlan:
    """A process's bucket table and the limits of one batch it runs."""

    table: BucketTable
    max_batch_patches: int
    max_batch_images: int


def process_plan(
    shape: TowerShape,
    device: str,
    buckets: Any = None,
    *,
    bucket_max_images: int | None = None,
    max_graph_tokens: int | None = None,
    max_batch_patches: int | None = None,
    max_batch_images: int | None = None,
) -> BucketPlan:
    """The table and batch limits of a process encoding on `device` ("cuda" or "cpu"): the operator's
    values where given, else the device's defaults (`DEVICE_DEFAULTS`), then `engine_table`."""
    defaults = DEVICE_DEFAULTS["cuda" if str(device).startswith("cuda") else "cpu"]
    device_default = buckets is None and bucket_max_images is None
    if buckets is None:
        buckets = defaults.buckets
        if bucket_max_images is None:
            bucket_max_images = defaults.bucket_max_images
    table = engine_table(shape, buckets, max_graph_tokens, bucket_max_images)
    patches = max_batch_patches or (device_default and defaults.max_batch_patches) or table.largest.budget
    images = max_batch_images or (device_default and defaults.max_batch_images) or table.largest.max_images
    return BucketPlan(table, int(patches), int(images))


def router_fallback_table() -> BucketTable:
    """The table a request router assumes while no replica has published its own: the engine default of a
    patch-14 model (256 .. MAX_BUDGET patches)."""
    return default_table()
