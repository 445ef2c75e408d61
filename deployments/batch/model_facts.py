"""What a batch job's driver knows about the model and its encoder actors, without loading weights.

The model's config and preprocessing (`config_for`, `preprocess_config_for`), its pooling, and the bucket
table its actors will have (`actor_plan`: the same `workspace.tables.process_plan` the actors call, with
the `max_graph_tokens` of the attention backend they will load), from which Ray Data's rows per encoder
batch are sized (`rows_per_batch`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from encoder.config import VisionConfig
from encoder.loading.hub import ResolvedModel, resolve_model
from encoder.preprocessing.config import ProcessorConfig
from workspace.tables import BucketPlan, TowerShape, process_plan

# `encoder.api` and `encoder.attention` (torch, ~3 s of CPU to import) are imported in the functions that
# need them: the CLI checks the model (`resolved`) before anything imports torch, so a bad one fails at once.


@lru_cache(maxsize=8)  # the driver asks several times; a Hub id would be looked up each time
def resolved(model: str) -> ResolvedModel:
    """`encoder.loading.hub.resolve_model` without the weights (the actors fetch them): a bad model fails here, on the
    driver, in one line, before Ray starts."""
    return resolve_model(model, download_weights=False)


def config_for(model: str) -> VisionConfig:
    """The tower config of a preset name, checkpoint directory or Hub id (no weights read)."""
    return resolved(model).config


def preprocess_config_for(model: str) -> ProcessorConfig:
    """The preprocessing `encoder.load(model)` uses, without building the model (cheap, driver side).

    A `VitPreprocessConfig` for CLIP / SigLIP models (same attributes where the pipeline reads them)."""
    from encoder.api import preprocess_config_for as model_preprocess_config

    source = resolved(model)
    return model_preprocess_config(source.config, source.path)


def video_config_for(model: str):
    """The model's video processor (`encoder.api.video_config_for`: the checkpoint's settings, or transformers'
    defaults), driver side; InvalidArgumentError for a tower without video."""
    from encoder.api import video_config_for as model_video_config
    from encoder.errors import InvalidArgumentError

    source = resolved(model)
    vcfg = model_video_config(source.config, source.path)
    if vcfg is None:
        raise InvalidArgumentError(
            f"model {model!r} takes no video: video needs a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 tower"
        )
    return vcfg


def typical_video_patches(vcfg) -> int:
    """A video's patches for sizing batches when not given (`--typical-patches`): the processor's pixel budget
    (Qwen3-VL: over all sampled frames; Qwen2-VL: of one frame) in patches, at least one frame pair's."""
    return max(vcfg.max_pixels // vcfg.patch_size**2, vcfg.temporal_patch_size * vcfg.merge_size**2)


def deepstack_layers(config: VisionConfig) -> int:
    """DeepStack layers of a tower (0 for towers without: Qwen2/2.5-VL, Qwen3.5, CLIP, SigLIP)."""
    return len(getattr(config, "deepstack_visual_indexes", None) or ())


def resolve_pooling(pooling: str | None, model: str) -> str:
    """`pooling`, checked; None: the model's default embedding ("model" for CLIP / SigLIP, else "mean")."""
    config = config_for(model)  # first: a bad model fails before torch is imported
    from encoder.api import resolve_pooling as model_pooling
    from encoder.api import vector_pooling

    return vector_pooling(config) if pooling is None else model_pooling(pooling, config)


def shape_of_config(config: VisionConfig, pp) -> TowerShape:
    """The model's `workspace.tables.TowerShape` from its config and preprocessing (what `shape_of_encoder`
    reads of the loaded model)."""
    from encoder.api import is_fixed_resolution

    per = config.num_patches if is_fixed_resolution(config) else None
    return TowerShape(config.merge_unit, per if per is not None else pp.num_patches(224, 224), per)


def actor_device(gpus: int) -> str:
    """The device the encoder actors run on: one GPU each when the job has GPUs."""
    return "cuda" if gpus > 0 else "cpu"


def _graph_cap(model: str, device: str, dtype: str | None, attention: str | None) -> int | None:
    from encoder.api import attention_plan
    from encoder.attention import graph_token_cap

    return graph_token_cap(attention_plan(config_for(model), device, dtype, attention))


def actor_graph_cap(model: str, device: str, dtype: str | None = None, attention: str | None = None) -> int | None:
    """`max_graph_tokens` of the attention backend the encoder actors will load. Which backends are usable
    depends on the machine, so a driver that cannot see CUDA asks a GPU worker once."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        import ray

        return ray.get(ray.remote(num_gpus=1)(_graph_cap).remote(model, device, dtype, attention))
    return _graph_cap(model, device, dtype, attention)


def actor_plan(model: str, device: str, buckets: Any = None, max_graph_tokens: int | None = None) -> BucketPlan:
    """The bucket table (and batch limits) of an encoder actor on `device`, from the model's config alone:
    the same `workspace.tables.process_plan` the actor itself calls."""
    return process_plan(
        shape_of_config(config_for(model), preprocess_config_for(model)), device, buckets,
        max_graph_tokens=max_graph_tokens,
    )  # fmt: skip


def rows_per_batch(plan: BucketPlan, typical_patches: int, fill: int = 2) -> int:
    """Rows per encoder batch so a batch holds about `fill` batches' worth of patches of the actor's limits."""
    rows = round(fill * plan.max_batch_patches / max(1, typical_patches))
    return int(min(max(rows, 1), fill * plan.max_batch_images))


def gpus_in_cluster() -> int:
    import ray

    from deployments.preflight import ray_address

    if not ray.is_initialized():
        ray.init(address=ray_address(None))
    return int(ray.cluster_resources().get("GPU", 0))


def check_actor_options(model: str, buckets: Any = None, dtype=None, attention=None) -> None:
    """The encoder actors' options checked on the driver before Ray starts (`preflight.check_encoder_options`,
    what a service's `build_app` checks)."""
    from deployments.preflight import check_encoder_options

    check_encoder_options(config_for(model), buckets, dtype, attention)


def plan_for_actors(model: str, gpus: int, buckets: Any = None, dtype=None, attention=None) -> BucketPlan:
    """The plan of the encoder actors of a job with `gpus` GPUs (0: CPU actors)."""
    device = actor_device(gpus)
    return actor_plan(model, device, buckets, actor_graph_cap(model, device, dtype, attention))
