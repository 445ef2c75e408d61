"""Exception types raised by the encoder package.

Every error a caller can trigger with bad input derives from `EncoderError`, so services can map the
whole family to a client error (HTTP 4xx) without catching unrelated bugs.
"""


class EncoderError(Exception):
    """Base class of every error the encoder raises for bad input, config or checkpoints."""


class ImageDecodeError(EncoderError):
    """The bytes given as an image are empty, truncated, corrupt or not an image format we accept."""


class InvalidImageError(EncoderError):
    """The image decoded but cannot be encoded: wrong type, bad shape/dtype, extreme aspect ratio."""


class ImageTooLargeError(InvalidImageError):
    """The image exceeds a configured size limit (pixels, bytes); also raised for decompression bombs."""


class ConfigError(EncoderError):
    """A model config, preset name or option is invalid or unknown."""


class CheckpointError(EncoderError):
    """A checkpoint directory is incomplete or does not match the model (missing/unexpected keys, shapes)."""


class BackendUnavailableError(ConfigError):
    """The requested attention backend cannot run here; the message lists the backends that can."""


class InvalidArgumentError(EncoderError, ValueError):
    """An argument has a value the encoder does not accept (unknown pooling mode, bad batch)."""


class RandomWeightsWarning(UserWarning):
    """A preset was loaded: its weights are seeded random numbers, not a trained model's."""
