"""Giving freed request memory back to the operating system (glibc's `malloc_trim`).

A big request's buffers (its body, the parsed base64 strings, the decoded image bytes) are freed when it
ends, but glibc keeps much of it: its mmap threshold grows to the largest block freed (up to 32 MiB), so
later blocks of that size come from the heap, and each thread's arena keeps its free top. Measured on the
CPU box (2026-12-01, `tests/integration/serve/test_reliability_admission.py`, 16 concurrent 48 MiB
requests): without the trim the ingress was still more than 400 MiB over its resident size before them 10 s
after they were answered; with it 118-209 MiB over, at once.
`trim_after(nbytes)` runs it after a request that held at least `TRIM_BYTES`, in a thread (the call
releases the GIL and walks every arena: milliseconds), at most one at a time. Elsewhere than glibc it
does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

logger = logging.getLogger("ray.serve")

TRIM_BYTES = 16 * 2**20


def _libc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


class MemoryTrimmer:
    """Runs `malloc_trim(0)` in `pool` after big requests (see the module docstring)."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self._running: asyncio.Future | None = None
        self.trims = 0

    def trim_after(self, nbytes: int) -> None:
        if _TRIM is None or nbytes < TRIM_BYTES or (self._running is not None and not self._running.done()):
            return
        self.trims += 1
        self._running = asyncio.get_running_loop().run_in_executor(self._pool, _TRIM, 0)
