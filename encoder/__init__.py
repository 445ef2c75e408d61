"""Vision towers, preprocessing, checkpoint loading and attention backends.

Families: Qwen2-VL / Qwen2.5-VL (variable resolution, `encoder.models.qwen2`), CLIP / SigLIP / DINOv2 / DINOv3
(fixed resolution, `encoder.models.vit`, `encoder.models.dinov2`, `encoder.models.dinov3`) and SigLIP2 NaFlex
(variable resolution, `encoder.models.vit`); models named by a preset, a checkpoint directory or a Hugging Face
Hub id (`encoder.loading.hub.resolve_model`); poolings "none", "mean", "model", "mean-l2", "model-l2"
(`encoder.api`).
"""

from encoder.config import (
    ClipVisionConfig,
    Dinov2VisionConfig,
    Dinov3VisionConfig,
    Qwen2VLVisionConfig,
    Qwen3VLVisionConfig,
    Qwen25VLVisionConfig,
    Siglip2VisionConfig,
    SiglipVisionConfig,
)
from encoder.errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    DecodeTimeoutError,
    DecodeWorkerError,
    EncoderError,
    ImageDecodeError,
    ImageTooComplexError,
    ImageTooLargeError,
    InvalidArgumentError,
    InvalidImageError,
    InvalidVideoError,
    RandomWeightsWarning,
    VideoDecodeError,
    VideoTooLargeError,
)
from encoder.lazy import lazy_exports
from encoder.loading.presets import PRESETS
from encoder.poolings import POOLINGS

# Names whose modules import torch are loaded on first use (PEP 562): processes that only decode and check
# images (the ingress replicas, their decode workers) import `encoder.<module>` without paying torch's
# ~2.7 s of import and ~200 MB of memory.
_LAZY = {
    "VisionEncoder": "api",
    "load": "api",
    "ResolvedModel": "loading.hub",
    "resolve_model": "loading.hub",
    "PatchBatch": "patch_batch",
    "VitPreprocessConfig": "preprocessing.vit",
}


__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "POOLINGS",
    "PRESETS",
    "BackendUnavailableError",
    "CheckpointError",
    "ClipVisionConfig",
    "ConfigError",
    "DecodeTimeoutError",
    "Dinov2VisionConfig",
    "Dinov3VisionConfig",
    "DecodeWorkerError",
    "EncoderError",
    "ImageDecodeError",
    "ImageTooComplexError",
    "ImageTooLargeError",
    "InvalidArgumentError",
    "InvalidImageError",
    "InvalidVideoError",
    "PatchBatch",
    "RandomWeightsWarning",
    "ResolvedModel",
    "Qwen2VLVisionConfig",
    "Qwen25VLVisionConfig",
    "Qwen3VLVisionConfig",
    "Siglip2VisionConfig",
    "SiglipVisionConfig",
    "VideoDecodeError",
    "VideoTooLargeError",
    "VisionEncoder",
    "VitPreprocessConfig",
    "load",
    "resolve_model",
]
