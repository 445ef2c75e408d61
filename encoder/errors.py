"""Exception types raised by the encoder package.

Every error a caller can trigger with bad input derives from `EncoderError`, so services can map the
whole family to a client error (HTTP 4xx) without catching unrelated bugs. Their messages are one
line each and never hold Python object reprs: a library's exception is worded with `reason`.
"""

import re
import warnings

# `<_io.BytesIO object at 0x7f...>`, `<PIL.PngImagePlugin.PngImageFile image mode=RGB size=1x1 at 0x...>`
_OBJECT_REPR = re.compile(r"\s*<[^<>]*\bat 0x[0-9a-fA-F]+>")


def named(value) -> str:
    """A value a caller passed, for an error message: a string as written (`'bf'`), anything else by its type only
    (`of type list`), never an object's repr."""
    return repr(value) if isinstance(value, str) else f"of type {type(value).__name__}"


class EncoderError(Exception):
    """Base class of every error the encoder raises for bad input, config or checkpoints."""


class ImageDecodeError(EncoderError):
    """The bytes given as an image are empty, truncated, corrupt or not an image format we accept."""


class InvalidImageError(EncoderError):
    """The image decoded but cannot be encoded: wrong type, bad shape/dtype, extreme aspect ratio."""


class ImageTooLargeError(InvalidImageError):
    """The image exceeds a configured size limit (pixels, bytes); also raised for decompression bombs."""


class ImageTooComplexError(ImageTooLargeError):
    """The encoded image's structure exceeds a limit that bounds decoding cost (JPEG scans, PNG chunks,
    frames or pages), found before decoding; a CPU decompression bomb such as a progressive-JPEG scan bomb."""


class DecodeTimeoutError(ImageTooComplexError):
    """Decoding one image took longer than its deadline; the worker process decoding it was killed."""


class DecodeWorkerError(ImageDecodeError):
    """The worker process decoding an image died (crash, out of memory, signal) before answering."""


class VideoDecodeError(ImageDecodeError):
    """The bytes given as a video are empty, truncated, corrupt, not a container we accept, or hold no video
    stream in a codec we decode."""


class InvalidVideoError(InvalidImageError):
    """The video decoded (or was given as frames) but cannot be encoded: no frames, too few, a bad array."""


class VideoTooLargeError(ImageTooLargeError):
    """The video exceeds a configured limit: encoded bytes, duration, frames, pixels per frame or in all."""


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

    @staticmethod
    def message(name: str) -> str:
        """The warning's text: what was loaded and how to load real weights instead."""
        return (
            f"model {name!r} is a preset with RANDOM weights: its embeddings carry no meaning. For real weights "
            "pass a Hugging Face Hub id (e.g. model=Qwen/Qwen2.5-VL-7B-Instruct) or a local checkpoint directory"
        )

    @classmethod
    def warn(cls, name: str, stacklevel: int = 1) -> None:
        """Issue it, attributed `stacklevel` frames above the caller (1: the caller's line). Once per preset and
        location, as warnings go by default (the registry keys on the text)."""
        warnings.warn(cls.message(name), cls, stacklevel=stacklevel + 1)


def reason(exc: BaseException) -> str:
    """A library's exception (Pillow, IO, safetensors, pydantic) as a phrase for our messages: its
    first line without object reprs (Pillow says `cannot identify image file <_io.BytesIO object at
    0x...>`), or its type name when nothing is left."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    text = _OBJECT_REPR.sub("", first).strip().rstrip(":").strip()
    return text or type(exc).__name__


def validation_reason(exc) -> str:
    """A pydantic ValidationError in one line: `field: message` for each error, `; `-separated (its
    own str() spans several lines and ends with a documentation URL)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', '')}" if where else str(err.get("msg", "")))
    return "; ".join(parts) or reason(exc)
