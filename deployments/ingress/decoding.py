"""Where the ingress opens and decodes a request's images: its event loop, its threads, its decode processes.

`IngressDecoder.prepare(images, pp, label, max_patches, reserve)`: allowlisted image URLs fetched
(concurrently), every image's header checked (`deployments.ingress.inputs.open_input`, structural limits included),
the request's patch total checked and reserved (`reserve`: the ingress's patch admission), then every image
decoded and resized to uint8. Nothing of an over-limit request is decoded. Errors name the input's position
(`input[3]: ...`); when one image fails, the request's other decodes are cancelled.

Where each decode runs (issue 17: a decode must be bounded and cancellable):
* encoded images go to `deployments.ingress.decode_pool.DecodePool` (`decode_processes` workers, started with the first
  request): a decode that overruns `decode_timeout_s` is killed with its worker (413 image_decode_timeout)
  and costs its sender that worker for at most the deadline; a cancelled request's decodes are stopped;
* one small picture (at most _INLINE_DECODE_PIXELS) is decoded or resized on the event loop, by
  measurement (`decode_resized` with the tiny preset's preprocessing, medians of 7-30 runs on the 2-core CPU
  box, 2026-12-01, load 1-4): a 224x224 PNG decodes and resizes in 0.90 ms inline (JPEG q90 1.2 ms) and
  2.1 ms through a 2-worker pool (JPEG 1.8 ms; the hop costs more than the decode), while the worst a
  picture that small can cost the loop is a progressive JPEG at the 100-scan limit (`tests.jpeg_bombs`):
  128x128 2.2 ms, 224x224 4.9 ms, 256x256 7.7 ms; 384x384 17 ms, 512x512 32 ms, 4096x4096 1.8 s: the pool
  above 256x256 (the fast path's 224x224 images stay inline, as before);
* decoded inputs of the handle API (PIL images, uint8 arrays) above that size are resized in the thread
  pool, as are the header checks of multi-image requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from deployments.aio import gather_or_cancel
from deployments.errors import with_index
from deployments.ingress.decode_pool import DecodePool, decode_resized, decode_video_frames
from deployments.ingress.inputs import Opened, finish_input, is_url, open_input, parse_video_string, source_pixels
from deployments.ingress.limits import check_request_patches
from deployments.ingress.security import UrlFetcher
from deployments.metrics import RecentTimings
from encoder.errors import EncoderError, InvalidVideoError, VideoTooLargeError
from encoder.preprocessing.config import ProcessorConfig
from encoder.preprocessing.video import prepare_frames

# A single input this small (encoded bytes / base64 text, or uint8 array bytes) is opened on the event loop,
# and decoded there too when it has at most _INLINE_DECODE_PIXELS pixels (see the module docstring).
_INLINE_DECODE_BYTES = 384 * 1024
_INLINE_DECODE_PIXELS = 256 * 256


def _where(label: str | Callable[[int], str], i: int) -> str:
    """How errors name image `i` of a request: `label[i]`, or `label(i)` (a request of text and image items names
    an image by its position among all of them)."""
    return label(i) if callable(label) else f"{label}[{i}]"


def _small(x: Any) -> bool:
    if isinstance(x, bytes | bytearray | memoryview | str):
        return len(x) <= _INLINE_DECODE_BYTES
    return isinstance(x, np.ndarray) and x.nbytes <= _INLINE_DECODE_BYTES


class IngressDecoder:
    """Header checks, patch totals and decoding of one ingress replica (see the module docstring)."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        urls: UrlFetcher,
        max_image_bytes: int,
        timings: RecentTimings,
        processes: int,
        timeout_s: float,
    ):
        self._pool, self._urls, self._max_bytes, self._timings = pool, urls, max_image_bytes, timings
        self._processes, self._timeout_s = processes, timeout_s
        # decode processes per kind of input: "image" (Pillow) and "video" (PyAV), each started by its first use
        self._pools: dict[str, DecodePool] = {}
        self._pools_lock = asyncio.Lock()
        self._warming: asyncio.Task | None = None

    async def _started(self, kind: str, cfg, decode_fn, preload: tuple[str, ...]) -> DecodePool:
        """The `kind` decode processes, started once, off the event loop (a fork server imports `preload`
        first). Ray's worker script is what the children import as __main__, so ray is preloaded with them."""
        if kind not in self._pools:
            async with self._pools_lock:
                if kind not in self._pools:
                    start = partial(DecodePool, self._processes, cfg=cfg, decode_fn=decode_fn, preload=preload)
                    self._pools[kind] = await asyncio.get_running_loop().run_in_executor(self._pool, start)
        return self._pools[kind]

    async def _decode_pool(self, pp: ProcessorConfig) -> DecodePool:
        """The image decode processes: Pillow decodes and resizes to the processor's size."""
        return await self._started("image", pp, decode_resized, ("encoder.preprocessing.qwen", "ray"))

    def warm(self, pp: ProcessorConfig) -> None:
        """Start the decode processes in the background if they are not (the first request, or /health
        before any: a load balancer's probe warms them before traffic comes)."""
        if "image" not in self._pools and self._warming is None:
            self._warming = asyncio.get_running_loop().create_task(self._decode_pool(pp))

    def pids(self) -> list[int]:
        """The decode processes' pids (none before the first request that needed them)."""
        return [pid for pool in self._pools.values() for pid in pool.pids]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

    async def _fetch_urls(self, images: list, label: str | Callable[[int], str]) -> list:
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
                raise with_index(e, _where(label, i)) from None
            return data

        fetched = await gather_or_cancel(one(i) for i in where)
        images = list(images)
        for i, data in zip(where, fetched, strict=True):
            images[i] = data
        return images

    async def _finish(self, i: int, o: Opened, pp: ProcessorConfig, label: str | Callable[[int], str]) -> np.ndarray:
        """Decode + resize one opened input: encoded bytes in a decode process, decoded inputs in a thread."""
        try:
            if o.data is not None:
                procs = await self._decode_pool(pp)
                return await procs.decode_async(o.data, self._timeout_s)
            return await asyncio.get_running_loop().run_in_executor(self._pool, finish_input, o, pp)
        except EncoderError as e:
            raise with_index(e, _where(label, i)) from None

    async def _video_pool(self, vcfg) -> DecodePool:
        """The video decode processes (started with the first video): PyAV decodes within the video limits, and
        a decode past `max_decode_s` is killed with its worker."""
        return await self._started("video", vcfg, decode_video_frames, ("encoder.preprocessing.video", "ray"))

    async def prepare_videos(
        self, videos: list, vcfg, label: str | Callable[[int], str]
    ) -> list[tuple[np.ndarray, list[float] | None, float | None]]:
        """Per video `(frames, timestamps, second_per_grid_ts)`: its sampled, resized frames (uint8 [n, h, w, 3]),
        Qwen3-VL's timestamps and Qwen2/2.5-VL's seconds per temporal patch (each None for the other), as
        the model's video processor (`vcfg`, a `VideoPreprocessConfig` with its `limits`): encoded videos (bytes,
        data URLs, base64) decoded in the video decode processes, killed past `max_decode_s` (+1 s); frame arrays
        (uint8 [frames, H, W, 3], taken at 24 fps) sampled and resized in the thread pool. Errors name the
        video's position; one failure cancels the rest."""
        loop = asyncio.get_running_loop()
        limits = vcfg.limits

        async def one(i: int, x: Any) -> tuple[np.ndarray, list[float] | None, float | None]:
            try:
                if isinstance(x, str):
                    x = parse_video_string(x, limits.max_bytes)
                if isinstance(x, bytes | bytearray | memoryview):
                    if len(x) > limits.max_bytes:
                        raise VideoTooLargeError(
                            f"video is {len(x)} bytes, over the limit max_bytes={limits.max_bytes}"
                        )
                    procs = await self._video_pool(vcfg)
                    frames, (stamps, per_grid) = await procs.decode_async(bytes(x), limits.max_decode_s + 1.0)
                    return frames, stamps, per_grid
                if isinstance(x, np.ndarray):
                    prepared = await loop.run_in_executor(self._pool, prepare_frames, x, None, vcfg)
                    return prepared.frames, prepared.timestamps, prepared.second_per_grid_ts
                raise InvalidVideoError(
                    f"unsupported video type {type(x).__name__}; expected encoded bytes, a data URL or base64 "
                    "string, or a uint8 array [frames, height, width, 3]"
                )
            except EncoderError as e:
                raise with_index(e, _where(label, i)) from None

        return await gather_or_cancel(one(i, x) for i, x in enumerate(videos))

    async def prepare(
        self,
        images: list,
        pp: ProcessorConfig,
        label: str | Callable[[int], str],
        max_patches: int | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> list[np.ndarray]:
        """Header checks of every image, the request's patch total (checked against `max_patches`, then
        handed to `reserve`, which may refuse it), then decode + resize."""
        self.warm(pp)
        images = await self._fetch_urls(images, label)
        loop = asyncio.get_running_loop()
        max_bytes = self._max_bytes

        def opened(i: int, x: Any) -> Opened:
            try:
                return open_input(x, pp, max_bytes)
            except EncoderError as e:
                raise with_index(e, _where(label, i)) from None

        def admit(total: int) -> None:
            if max_patches is not None:
                check_request_patches(total, max_patches)
            if reserve is not None:
                reserve(total)

        if len(images) == 1 and _small(images[0]):
            # Small input: header checks here; a small picture is decoded here too (see the module docstring)
            started = time.perf_counter()
            o = opened(0, images[0])
            admit(o.patches)
            if source_pixels(o) <= _INLINE_DECODE_PIXELS:
                opened_at = time.perf_counter()
                try:
                    out = finish_input(o, pp)
                except EncoderError as e:
                    raise with_index(e, _where(label, 0)) from None
                self._timings.add(open=opened_at - started, decode=time.perf_counter() - opened_at)
                return [out]
            headers = [o]
        else:
            headers = await gather_or_cancel(
                loop.run_in_executor(self._pool, opened, i, x) for i, x in enumerate(images)
            )
            admit(sum(o.patches for o in headers))
        return await gather_or_cancel(self._finish(i, o, pp, label) for i, o in enumerate(headers))
