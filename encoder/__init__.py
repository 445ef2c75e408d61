"""Vision towers, preprocessing, checkpoint loading and attention backends."""

from .api import VisionEncoder, load
from .config import PRESETS, Qwen2VLVisionConfig, Qwen25VLVisionConfig
from .errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    EncoderError,
    ImageDecodeError,
    ImageTooLargeError,
    InvalidArgumentError,
    InvalidImageError,
)
from .patch_batch import PatchBatch

__all__ = [
    "PRESETS",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "EncoderError",
    "ImageDecodeError",
    "ImageTooLargeError",
    "InvalidArgumentError",
    "InvalidImageError",
    "PatchBatch",
    "Qwen2VLVisionConfig",
    "Qwen25VLVisionConfig",
    "VisionEncoder",
    "load",
]
