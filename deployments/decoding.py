"""Where the ingress opens and decodes a request's images: on its event loop or in its thread pool.

`IngressDecoder.prepare(images, pp, label, max_patches)`: allowlisted image URLs fetched (concurrently),
every image's header checked (`deployments.inputs.open_input`), the request's patch total checked, then
every image decoded and resized to uint8 (`finish_input`). Nothing of an over-limit request is decoded.
One small input is opened on the event loop, and decoded there too when it is a small picture (a 224x224
PNG decodes in ~0.5 ms, less than two thread hand-offs at idle); everything else goes to the pool.
Errors name the input's position (`input[3]: ...`).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from encoder.errors import EncoderError
from encoder.preprocess import PreprocessConfig

from .errors import with_index
from .inputs import Opened, finish_input, is_url, open_input, source_pixels
from .limits import check_request_patches
from .metrics import RecentTimings
from .security import UrlFetcher

# A single input this small (encoded bytes / base64 text, or uint8 array bytes) is opened on the event loop,
# and decoded there too when it has at most _INLINE_DECODE_PIXELS pixels.
_INLINE_DECODE_BYTES = 384 * 1024
_INLINE_DECODE_PIXELS = 512 * 512


def _small(x: Any) -> bool:
    if isinstance(x, bytes | bytearray | memoryview | str):
        return len(x) <= _INLINE_DECODE_BYTES
    return isinstance(x, np.ndarray) and x.nbytes <= _INLINE_DECODE_BYTES


class IngressDecoder:
    """Header checks, patch totals and decoding of one ingress replica (see the module docstring)."""

    def __init__(self, pool: ThreadPoolExecutor, urls: UrlFetcher, max_image_bytes: int, timings: RecentTimings):
        self._pool, self._urls, self._max_bytes, self._timings = pool, urls, max_image_bytes, timings

    async def _fetch_urls(self, images: list, label: str) -> list:
        """Allowlisted image URLs -> their bytes (concurrently); other inputs unchanged. Without an allowlist
        URLs stay strings and are refused (400) when parsed."""
        if not self._urls.enabled:
            return images
        where = [i for i, x in enumerate(images) if isinstance(x, str) and is_url(x)]
        if not where:
            return images

        async def one(i: int) -> bytes:
            try:
                data, media = await self._urls.fetch(images[i])
            except EncoderError as e:
                raise with_index(e, f"{label}[{i}]") from None
            return data

        fetched = await asyncio.gather(*(one(i) for i in where))
        images = list(images)
        for i, data in zip(where, fetched, strict=True):
            images[i] = data
        return images

    async def prepare(
        self, images: list, pp: PreprocessConfig, label: str, max_patches: int | None = None
    ) -> list[np.ndarray]:
        """Header checks of every image, the request's patch total, then decode + resize."""
        images = await self._fetch_urls(images, label)
        loop = asyncio.get_running_loop()
        max_bytes = self._max_bytes

        def opened(i: int, x: Any) -> Opened:
            try:
                return open_input(x, pp, max_bytes)
            except EncoderError as e:
                raise with_index(e, f"{label}[{i}]") from None

        def finished(i: int, o: Opened) -> np.ndarray:
            try:
                return finish_input(o, pp)
            except EncoderError as e:
                raise with_index(e, f"{label}[{i}]") from None

        def whole(x: Any) -> np.ndarray:  # one image: one trip to the pool
            o = opened(0, x)
            if max_patches is not None:
                check_request_patches(o.patches, max_patches)
            return finished(0, o)

        if len(images) == 1:
            if not _small(images[0]):
                return [await loop.run_in_executor(self._pool, whole, images[0])]
            # Small input: header checks here; a small picture is decoded here too, a big one (a compressible
            # bomb) in the pool.
            started = time.perf_counter()
            o = opened(0, images[0])
            if max_patches is not None:
                check_request_patches(o.patches, max_patches)
            if source_pixels(o) <= _INLINE_DECODE_PIXELS:
                opened_at = time.perf_counter()
                out = finished(0, o)
                self._timings.add(open=opened_at - started, decode=time.perf_counter() - opened_at)
                return [out]
            return [await loop.run_in_executor(self._pool, finished, 0, o)]
        headers = await asyncio.gather(*(loop.run_in_executor(self._pool, opened, i, x) for i, x in enumerate(images)))
        if max_patches is not None:
            check_request_patches(sum(o.patches for o in headers), max_patches)
        return list(
            await asyncio.gather(*(loop.run_in_executor(self._pool, finished, i, o) for i, o in enumerate(headers)))
        )
