"""Image files named by path, for the library (`VisionEncoder.preprocess` / `encode`) and the CLI alike.

A `str` or `os.PathLike` given to `VisionEncoder.preprocess` / `encode` is a path to an image file (as on the
command line and in a batch job's path column). URLs and data URLs are not fetched: that is the service's
job (`deployments.ingress.inputs`), and `load_image` itself takes bytes, PIL images and arrays only.
No torch here: the CLI reads its files before the model (and torch) load.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from encoder.errors import EncoderError, InvalidArgumentError, reason

if TYPE_CHECKING:
    from encoder.patch_batch import PatchBatch

_SHOWN = 80  # characters of a path shown in an error (a base64 string passed by mistake is long)
_NOT_PATHS = ("http://", "https://", "data:")


def is_path(x: Any) -> bool:
    """Whether an input is a path to an image file (a str or os.PathLike)."""
    return isinstance(x, str | os.PathLike)


def path_name(path: str | os.PathLike) -> str:
    """A path as an error names it: as given, cut to 80 characters."""
    text = os.fsdecode(path)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def read_image_path(path: str | os.PathLike) -> bytes:
    """The bytes of the image file `path`; InvalidArgumentError naming it when it cannot be read."""
    text = os.fsdecode(path)
    if isinstance(path, str) and text.startswith(_NOT_PATHS):
        raise InvalidArgumentError(
            f"{path_name(path)}: a str image is a file path; URLs and data URLs are not fetched here, pass the "
            "encoded image bytes"
        )
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"{path_name(path)}: cannot read ({exc.strerror or reason(exc)})") from None


def preprocess_paths(images: Any, preprocess: Callable[[Any], PatchBatch], kind: str = "image") -> PatchBatch:
    """`preprocess(images)` with each path among `images` (one input or a list) read first. With paths, the
    images are preprocessed one by one, so an error names the image's position in a list and its file.
    `kind` names the inputs in errors ("image", "video")."""
    items = images if isinstance(images, list | tuple) else [images]
    if not any(is_path(x) for x in items):
        return preprocess(images)
    batches = []
    for i, x in enumerate(items):
        try:
            if not is_path(x):
                batches.append(preprocess(x))
                continue
            data = read_image_path(x)  # its errors name the file
            try:
                batches.append(preprocess(data))
            except EncoderError as exc:
                raise type(exc)(f"{path_name(x)}: {exc}") from None
        except EncoderError as exc:
            if len(items) == 1:
                raise
            raise type(exc)(f"{kind} {i}: {exc}") from None
    from encoder.patch_batch import PatchBatch  # torch: only once images are preprocessed

    return PatchBatch.concat(batches)
