"""Vision towers, preprocessing, checkpoint loading and attention backends.

Families: Qwen2-VL / Qwen2.5-VL (variable resolution, `encoder.qwen`) and CLIP / SigLIP (fixed
resolution, `encoder.vit`); models named by a preset, a checkpoint directory or a Hugging Face Hub id
(`encoder.hub.resolve_model`); poolings "none", "mean", "model", "mean-l2", "model-l2" (`encoder.api`).
"""

from .api import POOLINGS, VisionEncoder, load
from .config import ClipVisionConfig, Qwen2VLVisionConfig, Qwen3VLVisionConfig, Qwen25VLVisionConfig, SiglipVisionConfig
from .errors import (
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
    RandomWeightsWarning,
)
from .hub import ResolvedModel, resolve_model
from .patch_batch import PatchBatch
from .preprocess_vit import VitPreprocessConfig
from .presets import PRESETS

__all__ = [
    "POOLINGS",
    "PRESETS",
    "BackendUnavailableError",
    "CheckpointError",
    "ClipVisionConfig",
    "ConfigError",
    "DecodeTimeoutError",
    "DecodeWorkerError",
    "EncoderError",
    "ImageDecodeError",
    "ImageTooComplexError",
    "ImageTooLargeError",
    "InvalidArgumentError",
    "InvalidImageError",
    "PatchBatch",
    "RandomWeightsWarning",
    "ResolvedModel",
    "Qwen2VLVisionConfig",
    "Qwen25VLVisionConfig",
    "Qwen3VLVisionConfig",
    "SiglipVisionConfig",
    "VisionEncoder",
    "VitPreprocessConfig",
    "load",
    "resolve_model",
]
