"""`AppArgs`: the validated arguments of `build_app`, and the decisions derived from them.

The Serve CLI imports it to build the application on the driver (it loads no Ray Serve), and the replicas
re-validate the same dict in their constructors.
"""

from __future__ import annotations

import glob
import os
from typing import Any, TypeVar

from pydantic import BaseModel, model_validator

from deployments.app_args import (
    API_KEY_ENV,
    DEFAULT_IMAGE_FORMATS,
    BatchingArgs,
    BucketArgs,
    IngressArgs,
    LimitArgs,
    ModelArgs,
    ReplicaArgs,
)
from workspace.tables import BucketPlan, process_plan, shape_of_encoder

__all__ = ["API_KEY_ENV", "DEFAULT_IMAGE_FORMATS", "AppArgs", "replica_plan", "resolve_device", "resolve_num_gpus"]

INGRESS_NAME = "VisionIngress"
ENCODER_NAME = "VisionEncoder"
DEFAULT_APP_NAME = "default"  # the application's name everywhere: Serve's own default (`serve run deployments:app`)

G = TypeVar("G", bound=BaseModel)
# the groups by the name a nested `args:` section may use for them (`batching: {max_batch_size: 8}`)
GROUPS: dict[str, type[BaseModel]] = {
    "model": ModelArgs,
    "buckets": BucketArgs,
    "batching": BatchingArgs,
    "replicas": ReplicaArgs,
    "ingress": IngressArgs,
    "limits": LimitArgs,
}


# listed last to first: pydantic orders the fields of the first base last
class AppArgs(LimitArgs, IngressArgs, ReplicaArgs, BatchingArgs, BucketArgs, ModelArgs):
    """Arguments of `deployments:build_app` (also the `args:` of a Serve config YAML): the fields of its
    groups (`deployments.app_args`: model, buckets, batching, replicas, ingress, limits), flat.

    Strings from `serve run deployments:build_app key=value ...` are coerced (`num_replicas=2`,
    `num_gpus=0.5`, `ingress_batch_size=0`). A group may also be given as a mapping under its name
    (`{"batching": {"max_batch_size": 8}, "model": "tiny"}`): its keys are the same flat fields.
    """

    @model_validator(mode="before")
    @classmethod
    def _flatten_groups(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(isinstance(data.get(name), dict) for name in GROUPS):
            return data
        flat = {k: v for k, v in data.items() if not (k in GROUPS and isinstance(v, dict))}
        for name, group in GROUPS.items():
            section = data.get(name)
            if not isinstance(section, dict):
                continue
            unknown = set(section) - set(group.model_fields)
            if unknown:
                raise ValueError(f"{name}: unknown argument(s) {', '.join(sorted(unknown))}")
            twice = set(section) & set(flat)
            if twice:
                raise ValueError(f"{', '.join(sorted(twice))} given both flat and under {name!r}")
            flat.update(section)
        return flat

    def group(self, group: type[G]) -> G:
        """This application's arguments of one group (`args.group(BatchingArgs)`)."""
        return group.model_validate({name: getattr(self, name) for name in group.model_fields})


NVIDIA_DEVICE_FILES = "/dev/nvidia[0-9]*"  # one per GPU, made by NVIDIA's driver (and passed into containers)


def resolve_num_gpus(args: AppArgs) -> float:
    """GPUs per encoder replica: the explicit value, else 1 when the cluster (or this machine) has GPUs.

    `build_app` runs on the driver for `serve run` (before Ray is connected) and inside the controller's
    build task for `serve deploy`, which is often a head node without GPUs. So when Ray is connected its
    *cluster* resources decide (GPU worker nodes count); otherwise whether CUDA is visible here.
    An autoscaling cluster whose GPU nodes are not up yet has no GPU resources: set `num_gpus` there.
    `device="cpu"` forces 0.
    """
    if args.num_gpus is not None:
        return args.num_gpus
    if args.device == "cpu":
        return 0.0
    try:
        import ray

        if ray.is_initialized():
            return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    except Exception:  # noqa: BLE001 - no cluster info: fall back to the local check
        pass
    return 1.0 if local_gpu_visible() else 0.0


def local_gpu_visible() -> bool:
    """Whether this machine has an NVIDIA GPU this process may use, decided without importing torch where the
    driver's device files answer: the launcher runs this before Ray starts, and torch with CUDA's libraries plus
    CUDA's initialisation cost seconds of a cold start there. `CUDA_VISIBLE_DEVICES` empty or -1 hides the GPUs;
    /dev/nvidia0... say they exist; with neither (WSL, other systems) torch decides."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if glob.glob(NVIDIA_DEVICE_FILES):
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def resolve_device(args: AppArgs, num_gpus: float) -> str:
    """The encoder replica's torch device: a GPU share means cuda (unless forced)."""
    if args.device != "auto":
        return args.device
    return "cuda" if num_gpus > 0 else "cpu"


def replica_plan(args: AppArgs, vision, device: str) -> BucketPlan:
    """The bucket table and batch limits of an encoder replica running `vision` (a loaded
    `encoder.VisionEncoder`) on `device`: `workspace.tables.process_plan` of the app's arguments."""
    from encoder.attention import graph_token_cap  # torch: replicas only (the ingress never imports it)

    return process_plan(
        shape_of_encoder(vision),
        device,
        args.buckets,
        bucket_max_images=args.bucket_max_images,
        max_graph_tokens=graph_token_cap(vision.model.backends),
        max_batch_patches=args.max_batch_patches,
        max_batch_images=args.max_batch_size,
    )
