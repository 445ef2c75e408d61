"""Reading an image-path column's files: regular files only, at most `max_image_bytes`.

Why: a path is whatever the dataset says. A FIFO blocks `open()` until a writer appears (the job hung
silently), a character device such as /dev/zero never ends (the decode task read until memory ran out), and
a directory or socket is no image. So the file is opened non-blocking (a FIFO opens at once), checked to be a
regular file on the open descriptor (no race with a rename in between), refused when its size is over the
limit, and read with a bound of limit + 1 bytes (a file that grows while read is caught too). Every error
names the path and becomes that row's `error`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from encoder.errors import ImageDecodeError, ImageTooLargeError

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20  # the service's max_image_bytes default
_CHUNK = 1 << 20


def resolve(value: str, root: str | None) -> Path:
    """The file a path-column value names (`file://` stripped; relative paths under `root`)."""
    if value.startswith("file://"):
        value = value[len("file://") :]
    path = Path(value)
    return Path(root) / path if not path.is_absolute() and root is not None else path


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_image_file(path: Path, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes`; else ImageDecodeError / ImageTooLargeError
    naming the path; a file that cannot be opened raises the OSError of `open` (FileNotFoundError, ...), which
    names it too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageDecodeError(f"{path}: {_kind(st.st_mode)}, not a regular file: not read")
        if st.st_size > max_bytes:
            raise ImageTooLargeError(f"{path}: {st.st_size} bytes, over the limit of {max_bytes} (max_image_bytes)")
        os.set_blocking(fd, True)  # a regular file: plain reads
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise ImageTooLargeError(f"{path}: more than {max_bytes} bytes (max_image_bytes; it grew while read)")
        return b"".join(chunks)
    except OSError as e:
        raise ImageDecodeError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
