"""What the ingress's Python handle methods do (`VisionIngress.embed`, `embed_llm`, `embed_text` delegate here).

Same path as HTTP without the HTTP parts: admission (a `BackPressureError` at once when this replica is
full: requests, bytes of inputs or patches, `limits.Admission`; 503 while the service shuts down), the images
(`IngressDecoder`) and the encoder call (`EncoderClient`) under the request's time limit (`TimeoutError`).
Bad inputs raise the replica's or the decoder's own `encoder.EncoderError`, never Ray's wrapper; the
per-request limits (images, patches) are HTTP's. This module checks the arguments and shapes the outcome; the
request's life (admission, decode, deadline, encoder call, accounting) is `lifecycle.Lifecycle`'s.
"""

from __future__ import annotations

import time

from deployments.config import AppArgs
from deployments.errors import CLIENT_ERROR, classify, root_cause
from deployments.ingress.cache import EncoderCache, check_cache_uuids, handed_out
from deployments.ingress.decoding import IngressDecoder
from deployments.ingress.encoder_calls import EncoderClient
from deployments.ingress.lifecycle import EmbedOrder, Flight, Lifecycle
from deployments.ingress.limits import Admission
from deployments.llm_outputs import check_dtype
from deployments.metrics import IngressTelemetry
from deployments.shutdown import DrainWatch, ShuttingDownError
from deployments.vllm_handoff import check_layout
from encoder.errors import EncoderError, InvalidArgumentError
from encoder.poolings import check_pooling
from encoder.tokenization import check_texts


def _nbytes(x) -> int:
    """What an input holds in this process (encoded bytes, text, array pixels; a PIL image's pixels)."""
    if isinstance(x, bytes | bytearray | memoryview | str):
        return len(x)
    nbytes = getattr(x, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    size = getattr(x, "size", None)
    return size[0] * size[1] * 4 if isinstance(size, tuple) and len(size) == 2 else 0


class HandleCalls:
    """The handle API of one ingress replica (see the module docstring)."""

    def __init__(
        self,
        args: AppArgs,
        client: EncoderClient,
        decoder: IngressDecoder,
        admission: Admission,
        telemetry: IngressTelemetry,
        drain: DrainWatch | None = None,
        cache: EncoderCache | None = None,
    ):
        self.args = args
        self._lifecycle = Lifecycle(args, client, decoder, admission, telemetry, drain, cache)

    async def __call__(
        self, images, pooling: str | None, llm: str | None, layout: str = "parts", videos=None, cache: bool = True,
        cache_uuids=None,
    ) -> list:  # fmt: skip
        """Per image, then per video, a pooled vector (`llm` None) or a `WireLLM` tuple in the wire dtype `llm`
        (`layout` "vllm": its tokens and DeepStack layers concatenated, `vllm_handoff.vllm_wire`); a video's tuple
        has its facts after the grid, `(..., timestamps, second_per_grid_ts)` (`llm_outputs.VIDEO_FACTS`: Qwen3-VL's
        timestamps, Qwen2/2.5-VL's second_per_grid_ts, None otherwise). `cache`: False bypasses the encoder cache;
        `cache_uuids`: per image the caller's own cache key or None (handle callers are one scope); videos are
        never cached (always decoded and encoded)."""
        started = time.perf_counter()
        if images is None:
            images = []
        elif not isinstance(images, list | tuple):
            images = [images]
            cache_uuids = [cache_uuids] if isinstance(cache_uuids, str) else cache_uuids
        if videos is None:
            videos = []
        elif not isinstance(videos, list | tuple):
            videos = [videos]
        images = [*images, *videos]  # counted together below; split again for the order
        if self._lifecycle.refused_draining("handle", len(images), started):  # 503, come back elsewhere
            raise ShuttingDownError(retry_after_s=self.args.retry_after_s)

        async def body(flight: Flight) -> list:
            flight.reserve_bytes(sum(_nbytes(x) for x in images))
            flight.enter()
            if pooling is not None:
                check_pooling(pooling)
            if llm is not None:
                check_dtype(llm)
            check_layout(layout)
            n_images = len(images) - len(videos)
            order = EmbedOrder(images[:n_images], pooling, llm, layout=layout, videos=list(videos), cache=_flag(cache),
                               uuids=check_cache_uuids(cache_uuids, n_images, "cache_uuids"))  # fmt: skip
            return [handed_out(x) for x in await self._lifecycle.encode(flight, order)]

        return await self._lifecycle.run("handle", len(images), body, _failed, started=started)

    async def ec_cache(self, images, uuids, dtype: str | None, cache: bool = True, cache_uuids=None) -> list[dict]:
        """Each image's vLLM-layout tensor written for vLLM's disk connector under `ec_cache_dir`, as
        `<uuid>/encoder_cache.safetensors` (`write_ec_cache`); per image `{"uuid", "path", "shape", "dtype",
        "grid_thw", ...}`. `dtype` None: the served tower's own."""
        started = time.perf_counter()
        if not isinstance(images, list | tuple):
            images, uuids = [images], [uuids] if isinstance(uuids, str) else uuids
            cache_uuids = [cache_uuids] if isinstance(cache_uuids, str) else cache_uuids
        if self._lifecycle.refused_draining("handle", len(images), started):
            raise ShuttingDownError(retry_after_s=self.args.retry_after_s)

        async def body(flight: Flight) -> list:
            checked = self._lifecycle.check_ec_cache(uuids, len(images), False, "uuids")
            flight.reserve_bytes(sum(_nbytes(x) for x in images))
            flight.enter()
            if not images:
                return []
            wire = self._lifecycle.ec_cache_dtype(None if dtype is None else check_dtype(dtype),
                                                  await self._lifecycle.info())  # fmt: skip
            order = EmbedOrder(list(images), "none", wire, layout="vllm", cache=_flag(cache),
                               uuids=check_cache_uuids(cache_uuids, len(images), "cache_uuids"))  # fmt: skip
            return await self._lifecycle.write_ec_cache(flight, order, checked)

        return await self._lifecycle.run("handle", len(images), body, _failed, started=started)

    async def text(self, texts, pooling: str | None, cache: bool = True) -> list:
        """Per text its float32 vector (`embed_text`): texts checked here (`InvalidArgumentError` naming
        `texts[i]`), then the same lifecycle as images."""
        started = time.perf_counter()
        if isinstance(texts, str):
            texts = [texts]
        n = len(texts) if isinstance(texts, list | tuple) else 0
        if self._lifecycle.refused_draining("handle", n, started):
            raise ShuttingDownError(retry_after_s=self.args.retry_after_s)

        async def body(flight: Flight) -> list:
            checked = check_texts(texts)
            flight.reserve_bytes(sum(len(t) for t in checked))
            flight.enter()
            if pooling is not None:
                check_pooling(pooling)
            order = EmbedOrder([], pooling, texts=checked, cache=_flag(cache))
            return [handed_out(x) for x in await self._lifecycle.encode(flight, order)]

        return await self._lifecycle.run("handle", n, body, _failed, started=started)


def _flag(cache) -> bool:
    if not isinstance(cache, bool):
        raise InvalidArgumentError(f"cache must be True or False, not {type(cache).__name__}")
    return cache


def _failed(e: Exception, flight: Flight, expired: bool) -> tuple[BaseException, str]:
    """What a handle caller gets: the replica's or the decoder's own exception, not Ray's wrapper."""
    if isinstance(e, EncoderError):
        return root_cause(e), CLIENT_ERROR
    return e, classify(e).error.outcome
