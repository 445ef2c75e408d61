"""The ingress (CPU): OpenAI-compatible HTTP API and the Python handle API.

Per HTTP request: API key (401), admission (429 at once when this replica has `inflight_limit` requests
in flight), Content-Type (415) and body size (413), JSON and schema (400 / 422), then per image in a
thread pool: base64 / data URL (400), encoded size, format and pixels from the header (413 / 415), the
request's patch total (413) before anything is decoded, decode and resize to uint8 at the smart_resize
size (`load_image` + `resize_image`), and the compact uint8 arrays go to an encoder replica with
`encode_pixels(pixels, pooling=..., num_patches=n)` (pooled vectors) or `encode_llm_pixels(pixels, dtype=...,
num_patches=n)` (per-token LLM-ready outputs: HTTP `pooling: "none"`, the handle's `embed_llm`), retried
(bounded, with backoff) when the replica died or is unavailable, under the request's time limit (504).
Optionally (`ingress_batch_size` > 1) calls that queue while `ingress_max_concurrent_batches` merged encoder
requests are in flight are merged into the next one (no timer: an idle call goes out at once), so many
one-image clients cost the encoder replica few Serve requests.
The request schema, decoding and error mapping are in `deployments.openai_api`; limits, admission and
retries in `deployments.limits`; the API key and URL policy in `deployments.security`.
"""

# No `from __future__ import annotations` here: FastAPI must see the request model class itself in the
# route signatures of the Serve ingress class.
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from encoder.api import check_pooling
from encoder.errors import EncoderError
from encoder.preprocess import PreprocessConfig
from encoder.preprocess_vit import preprocess_config_from_dump

from .batching import ContinuousBatcher
from .config import ENCODER_NAME, AppArgs
from .errors import ErrorCode, RequestError, classify, root_cause, with_index
from .inputs import (
    Opened,
    finish_input,
    harden_pillow,
    ingress_preprocess_config,
    is_url,
    open_input,
    source_pixels,
)
from .limits import Admission, call_with_retries, check_content_type, check_request_patches, read_body
from .llm_outputs import check_dtype, handle_item
from .metrics import IngressMetrics, RecentTimings, rss_bytes
from .openai_api import EmbeddingRequest, api, embeddings_body, error_response, parse_embedding_request
from .ray_compat import by_reference, call_as_new_request, check_ray
from .security import ApiKeyAuth, UrlFetcher

logger = logging.getLogger("ray.serve")


# ------------------------------------------------------------------------------------------ deployment
# Helpers the deployment class uses are defined above it: Serve serialises the class when decorated.


def encoder_ready(status, app_name: str) -> tuple[bool, str]:
    """Whether `serve.status()` shows the app's encoder replicas running.

    A replica is RUNNING only after its constructor returned, and the constructor captures every
    bucket graph, so HEALTHY (running == target, health checks passing) means all graphs are captured.
    While the deployment is first deployed or updated (UPDATING) the answer is no. While the autoscaler
    adds or removes replicas (UPSCALING / DOWNSCALING) the running replicas keep serving with their graphs
    captured, and a replica joins the routing only once running, so the answer stays yes: a load balancer
    must not pull every ingress because the service is growing.
    """
    app = status.applications.get(app_name)
    dep = app.deployments.get(ENCODER_NAME) if app is not None else None
    if dep is None:
        return False, f"deployment {ENCODER_NAME} not found in application {app_name!r}"
    running = sum(n for state, n in dep.replica_states.items() if state == "RUNNING")
    state = getattr(dep.status, "value", dep.status)
    serving = state in ("HEALTHY", "UPSCALING", "DOWNSCALING")
    return serving and running > 0, f"{ENCODER_NAME}: {state}, {running} replica(s) running"


@dataclass
class Call:
    """One caller's images waiting to be merged with others into an encoder request."""

    arrays: list[np.ndarray]
    counts: list[int]
    pooling: str
    llm: str | None = None  # LLM-ready outputs in this wire dtype (`encode_llm_pixels`) instead of pooled vectors

    @property
    def patches(self) -> int:
        return sum(self.counts)


_ANSWER_COUNTS = {
    "client_error": "client_errors",
    "overloaded": "rejected",
    "timeout": "timed_out",
    "server_error": "server_errors",
}


def chunk(counts: list[int], max_patches: int, max_images: int) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive images, each within the encoder's batch limits."""
    ranges, start, total = [], 0, 0
    for i, c in enumerate(counts):
        if i > start and (total + c > max_patches or i - start >= max_images):
            ranges.append((start, i))
            start, total = i, 0
        total += c
    if counts:
        ranges.append((start, len(counts)))
    return ranges


_OPENAPI_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": EmbeddingRequest.model_json_schema(ref_template="#/$defs/{model}")}},
    }
}
# Bodies above this are parsed off the event loop.
_PARSE_INLINE_BYTES = 256 * 1024
# A single input this small (encoded bytes / base64 text, or uint8 array bytes) is opened on the event loop,
# and decoded there too when it has at most _INLINE_DECODE_PIXELS pixels.
_INLINE_DECODE_BYTES = 384 * 1024


_INLINE_DECODE_PIXELS = 512 * 512


def _small(x: Any) -> bool:
    if isinstance(x, bytes | bytearray | memoryview | str):
        return len(x) <= _INLINE_DECODE_BYTES
    return isinstance(x, np.ndarray) and x.nbytes <= _INLINE_DECODE_BYTES


# Encoder requests with more pixel bytes than this go by reference (object store), not inline over gRPC.
_INLINE_BYTES = 2 * 2**20

# Answers costing more than this (float32 elements written as JSON text; an element in base64 is counted as
# 1/40 of one) are built in the thread pool. Measured on a CPU of the project machines: 64 x 3,584 float32
# tokens take ~6 ms as JSON text and ~0.1 ms as base64, less than the hand-off to a thread and back.
_ANSWER_INLINE = 65536


def _answer_cost(outputs: list, encoding_format: str) -> float:
    elements = 0
    for o in outputs:
        if isinstance(o, tuple):
            elements += o[0].size * (1 + len(o[1]))
        else:
            elements += o.size
    return elements if encoding_format != "base64" else elements / 40


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api)
class VisionIngress:
    """HTTP routes (`/v1/embeddings`, `/v1/models`, `/health`) and the handle method `embed`."""

    def __init__(self, encoder: DeploymentHandle, args: dict):
        check_ray()
        self.args = a = AppArgs.model_validate(args)
        self._encoder = encoder
        # Big payloads go through Ray's object store (shared memory on one node, no gRPC message cap) even
        # when Serve sends requests over gRPC (RAY_SERVE_THROUGHPUT_OPTIMIZED=1); small ones stay inline.
        self._encoder_by_ref = by_reference(encoder)
        self._model_name = a.model_name
        self._pool = ThreadPoolExecutor(a.decode_threads, thread_name_prefix="decode")
        self._info: dict | None = None
        self._info_lock = asyncio.Lock()
        self._health: tuple[float, bool, str] = (0.0, False, "")
        self._created = int(time.time())
        self.metrics = IngressMetrics()
        # per route, the last requests' phases (parse, decode, encoder call, answer): `ingress_stats()["timings_ms"]`
        self._timings = {"http": RecentTimings(), "handle": RecentTimings(), "inline_decode": RecentTimings()}
        self._counts = {
            "merged_calls": 0,
            "merged_batches": 0,
            "encoder_requests": 0,
            "encoder_retries": 0,
            "rejected_overload": 0,
            "encoder_backpressure": 0,
            # HTTP error answers: 4xx (but 408/429), 429/503, 408/504, other 5xx
            **dict.fromkeys(_ANSWER_COUNTS.values(), 0),
        }
        harden_pillow(a.max_image_pixels)
        self._auth = ApiKeyAuth.from_args(a)
        self._urls = UrlFetcher.from_args(a)
        self._admission = Admission(a.inflight_limit)
        self._merge = None
        if a.ingress_batch_size > 1:
            limit = a.ingress_batch_size
            self._merge = ContinuousBatcher(
                self._run_merged, lambda patches, images: images <= limit, a.ingress_max_concurrent_batches
            )
        logger.info(
            "vision ingress: API key %s, URL fetching %s, %d requests in flight at most, %gs per request",
            "required" if self._auth.enabled else "off",
            f"from {', '.join(a.url_allowlist)}" if self._urls.enabled else "off",
            a.inflight_limit, a.request_timeout_s,
        )  # fmt: skip

    # -- facts from the encoder replicas ------------------------------------------------------------------
    async def info(self) -> dict:
        """The encoder's `describe()` (model, out_dim, preprocessing, batch limits), fetched once; its
        `preprocess_config` carries this application's decode limits (pixels, formats)."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    info = await self._retrying(lambda: call_as_new_request(self._encoder.describe))
                    model_pp = preprocess_config_from_dump(info["preprocess"])
                    info["preprocess_config"] = ingress_preprocess_config(
                        model_pp, self.args.max_image_pixels, self.args.image_formats
                    )
                    self._info = info
        return self._info

    async def _retrying(self, make_call):
        def retried(error: BaseException, attempt: int) -> None:
            self._counts["encoder_retries"] += 1
            self.metrics.retries.inc()
            logger.warning("encoder call failed (%s: %s); retry %d", type(error).__name__, error, attempt)

        try:
            return await call_with_retries(
                make_call, self.args.encoder_retries, self.args.encoder_retry_backoff_s, retried
            )
        except BackPressureError:
            self._counts["encoder_backpressure"] += 1
            raise

    # -- the shared path ------------------------------------------------------------------------------------
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

    async def _prepare(
        self, images: list, pp: PreprocessConfig, label: str, max_patches: int | None = None
    ) -> list[np.ndarray]:
        """Header checks of every image, the request's patch total, then decode + resize (thread pool)."""
        images = await self._fetch_urls(images, label)
        loop = asyncio.get_running_loop()
        max_bytes = self.args.max_image_bytes

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
            # Small input: header checks here; a small picture (a 224x224 PNG decodes in ~0.5 ms, less than
            # two thread hand-offs at idle) is decoded here too, a big one (a compressible bomb) in the pool.
            started = time.perf_counter()
            o = opened(0, images[0])
            if max_patches is not None:
                check_request_patches(o.patches, max_patches)
            if source_pixels(o) <= _INLINE_DECODE_PIXELS:
                opened_at = time.perf_counter()
                out = finished(0, o)
                self._timings["inline_decode"].add(open=opened_at - started, decode=time.perf_counter() - opened_at)
                return [out]
            return [await loop.run_in_executor(self._pool, finished, 0, o)]
        headers = await asyncio.gather(*(loop.run_in_executor(self._pool, opened, i, x) for i, x in enumerate(images)))
        if max_patches is not None:
            check_request_patches(sum(o.patches for o in headers), max_patches)
        return list(
            await asyncio.gather(*(loop.run_in_executor(self._pool, finished, i, o) for i, o in enumerate(headers)))
        )

    async def _encode(self, arrays: list[np.ndarray], pooling: str, llm: str | None = None) -> tuple[list, int]:
        """Per image a pooled vector (`llm` None) or a `WireLLM` tuple in the wire dtype `llm`; and the patches."""
        info = await self.info()
        p = info["preprocess_config"].patch_size
        counts = [(x.shape[0] // p) * (x.shape[1] // p) for x in arrays]
        if self._merge is not None and len(arrays) < self.args.ingress_batch_size:
            self._counts["merged_calls"] += 1
            return await self._merge(Call(arrays, counts, pooling, llm)), sum(counts)
        return await self._send(arrays, counts, pooling, llm), sum(counts)

    async def _send(self, arrays: list[np.ndarray], counts: list[int], pooling: str, llm: str | None = None) -> list:
        info = await self.info()
        parts = chunk(counts, info["max_batch_patches"], info["max_batch_images"])

        def call(s: int, e: int):
            handle = self._encoder_by_ref if sum(x.nbytes for x in arrays[s:e]) > _INLINE_BYTES else self._encoder
            n = sum(counts[s:e])
            if llm is not None:
                return lambda: call_as_new_request(handle.encode_llm_pixels, arrays[s:e], dtype=llm, num_patches=n)
            return lambda: call_as_new_request(handle.encode_pixels, arrays[s:e], pooling=pooling, num_patches=n)

        self._counts["encoder_requests"] += len(parts)
        if len(parts) == 1:
            return await self._retrying(call(*parts[0]))
        results = await asyncio.gather(*(self._retrying(call(s, e)) for s, e in parts))
        return [v for part in results for v in part]

    async def _run_merged(self, calls: list[Call]) -> list[list[np.ndarray]]:
        self._counts["merged_batches"] += 1
        out: list[list | None] = [None] * len(calls)
        groups: dict[tuple[str, str | None], list[int]] = {}
        for i, c in enumerate(calls):
            groups.setdefault((c.pooling, c.llm), []).append(i)

        async def run(mode: tuple[str, str | None], members: list[int]) -> None:
            arrays = [x for i in members for x in calls[i].arrays]
            counts = [n for i in members for n in calls[i].counts]
            self.metrics.merged.observe(len(arrays))
            vectors = await self._send(arrays, counts, *mode)
            pos = 0
            for i in members:
                out[i] = vectors[pos : pos + len(calls[i].arrays)]
                pos += len(calls[i].arrays)

        if len(groups) == 1:  # the usual case: no task for gather to wrap it in
            await run(*next(iter(groups.items())))
        else:
            await asyncio.gather(*(run(p, m) for p, m in groups.items()))
        return out

    def ingress_stats(self) -> dict:
        """Counters of this ingress replica: calls through the merger, merged batches, encoder requests and
        retries, rejections, timeouts, errors; requests in flight (now, peak, limit) and resident memory."""
        return dict(self._counts) | {
            "inflight": self._admission.inflight,
            "peak_inflight": self._admission.peak,
            "inflight_limit": self._admission.limit,
            "rss_bytes": rss_bytes(),
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "timings_ms": {route: t.p50_ms() for route, t in self._timings.items()},
        }

    def _overloaded(self) -> BackPressureError:
        self._counts["rejected_overload"] += 1
        return BackPressureError(
            self._admission.inflight, self._admission.limit, status_code=429, retry_after_s=self.args.retry_after_s
        )

    # -- Python handle API ------------------------------------------------------------------------------------
    async def embed(self, images, pooling: str | None = None) -> list[np.ndarray]:
        """Embeddings of `images` (a list of encoded bytes, PIL images, uint8 arrays, data URLs or base64
        strings; a single image is treated as a list of one): per image a float32 array, [out_dim] for
        pooling="mean", [tokens, out_dim] for "none". Raises `encoder.EncoderError` subclasses for bad
        inputs (the message names the position, e.g. "images[3]: ..."), `ray.serve.exceptions.BackPressureError`
        when the service is over capacity and `TimeoutError` past `request_timeout_s`. The per-image limits
        (encoded bytes, pixels, formats) apply; the per-request ones (images, patches) are HTTP's."""
        return await self._handle_call(images, pooling, None)

    async def embed_llm(self, images, dtype: str = "float32") -> list[dict]:
        """What a VLM's LLM needs in place of its vision tower, per image (inputs, limits and errors as `embed`):
        `{"tokens": [n, out_dim], "deepstack": [[n, out_dim] per DeepStack layer, model order; [] for towers
        without], "grid_thw": [t, h, w]}` (the patch grid, as the Hugging Face processor's `image_grid_thw`).
        The arrays are float32, or with `dtype="float16"` np.float16, with `dtype="bfloat16"` np.uint16 holding
        bfloat16 bit patterns (`torch.from_numpy(x).view(torch.bfloat16)`); both halve what crosses processes."""
        return [handle_item(w) for w in await self._handle_call(images, "none", dtype)]

    async def _handle_call(self, images, pooling: str | None, llm: str | None) -> list:
        started = time.perf_counter()
        if not isinstance(images, list | tuple):
            images = [images]
        if not self._admission.try_enter():
            self.metrics.request("handle", "overloaded", len(images), 0, time.perf_counter() - started)
            raise self._overloaded()
        outcome, n_images, patches = "client_error", len(images), 0
        try:
            if pooling is not None:
                check_pooling(pooling)
            if llm is not None:
                check_dtype(llm)
            if not images:
                outcome = "ok"
                return []
            async with asyncio.timeout(self.args.request_timeout_s):
                info = await self.info()
                pooling = pooling or info["default_pooling"]
                decode_at = time.perf_counter()
                arrays = await self._prepare(list(images), info["preprocess_config"], "images")
                encode_at = time.perf_counter()
                vectors, patches = await self._encode(arrays, pooling, llm)
            outcome = "ok"
            done = time.perf_counter()
            self._timings["handle"].add(total=done - started, decode=encode_at - decode_at, encode=done - encode_at)
            return vectors
        except EncoderError as e:
            raise root_cause(e) from None  # the replica's own exception, not Ray's wrapper
        except Exception as e:
            outcome = classify(e).error.outcome
            raise
        finally:
            self._admission.leave()
            self.metrics.request("handle", outcome, n_images, patches, time.perf_counter() - started)

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _error(self, exc: BaseException) -> tuple[Response, str]:
        """The error answer and its metrics outcome."""
        outcome = classify(exc).error.outcome
        self._counts[_ANSWER_COUNTS[outcome]] += 1
        return error_response(exc, self.args.retry_after_s), outcome

    @api.post("/v1/embeddings", openapi_extra=_OPENAPI_BODY)
    async def embeddings(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            self._auth.check(request.headers.get("authorization"))
        except RequestError as e:
            self.metrics.request("http", "unauthorized", 0, 0, time.perf_counter() - started)
            return self._error(e)[0]
        if not self._admission.try_enter():
            self.metrics.request("http", "overloaded", 0, 0, time.perf_counter() - started)
            return self._error(self._overloaded())[0]
        n_images, patches = 0, 0
        reading = True
        timer = asyncio.timeout(self.args.request_timeout_s)
        try:
            async with timer:
                check_content_type(request.headers.get("content-type"))
                body = await read_body(request, self.args.max_request_bytes)
                reading = False
                if len(body) > _PARSE_INLINE_BYTES:
                    parsed = await asyncio.get_running_loop().run_in_executor(self._pool, parse_embedding_request, body)
                else:
                    parsed = parse_embedding_request(body)
                del body
                inputs = [parsed.input] if isinstance(parsed.input, str) else parsed.input
                n_images = len(inputs)
                content, patches = await self._embeddings(parsed, inputs, started)
            self.metrics.request("http", "ok", n_images, patches, time.perf_counter() - started)
            return Response(content=content, media_type="application/json")
        except Exception as e:
            if isinstance(e, TimeoutError) and timer.expired():
                if reading:  # the client did not finish sending its body in time
                    e = RequestError(
                        f"the request body did not arrive within {self.args.request_timeout_s:g}s",
                        ErrorCode.REQUEST_TIMEOUT, None,
                    )  # fmt: skip
            response, outcome = self._error(e)
            self.metrics.request("http", outcome, n_images, patches, time.perf_counter() - started)
            return response
        finally:
            self._admission.leave()

    async def _embeddings(self, body: EmbeddingRequest, inputs: list[str], started: float) -> tuple[bytes, int]:
        a = self.args
        if body.model is not None and body.model != self._model_name:
            raise RequestError(
                f"model {body.model!r} is not served here; available: {self._model_name!r}",
                ErrorCode.MODEL_NOT_FOUND, "model",
            )  # fmt: skip
        if len(inputs) > a.max_request_images:
            raise RequestError(
                f"{len(inputs)} images in one request; the limit is {a.max_request_images}", ErrorCode.TOO_MANY_IMAGES
            )
        info = await self.info()
        pooling = body.pooling or info["default_pooling"]
        dim = info["output_dims"].get(pooling)
        if dim is None:
            raise RequestError(
                f"pooling {pooling!r} is not supported by this model; supported: {', '.join(info['output_dims'])}",
                ErrorCode.INVALID_POOLING, "pooling",
            )  # fmt: skip
        if body.dimensions is not None and body.dimensions != dim:
            raise RequestError(
                f"dimensions={body.dimensions} is not supported; this model outputs {dim} with pooling={pooling}",
                ErrorCode.INVALID_DIMENSIONS, "dimensions",
            )  # fmt: skip
        decode_at = time.perf_counter()
        arrays = await self._prepare(inputs, info["preprocess_config"], "input", a.max_request_patches)
        encode_at = time.perf_counter()
        # pooling none: the LLM-ready outputs (tokens, DeepStack, patch grid), cast on the replica to the
        # base64 element type (a bfloat16 answer crosses from the replica at half the bytes)
        dtype = body.embedding_dtype
        llm = dtype if pooling == "none" else None
        vectors, patches = await self._encode(arrays, pooling, llm)
        answer_at = time.perf_counter()
        del arrays
        args = (vectors, body.encoding_format, self._model_name, patches, dtype)
        if _answer_cost(vectors, body.encoding_format) > _ANSWER_INLINE:  # keep big encodes off the event loop
            content = await asyncio.get_running_loop().run_in_executor(self._pool, embeddings_body, *args)
        else:
            content = embeddings_body(*args)
        done = time.perf_counter()
        self._timings["http"].add(
            total=done - started, parse=decode_at - started, decode=encode_at - decode_at,
            encode=answer_at - encode_at, answer=done - answer_at,
        )  # fmt: skip
        return content, patches

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._auth.check(request.headers.get("authorization"))
        except RequestError as e:
            return self._error(e)[0]
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self._model_name, "object": "model", "created": self._created, "owned_by": "vision"}],
            }
        )

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once every encoder replica of this application is running (constructed = graphs captured).
        Open without the API key (load balancers probe it); it reveals the model name and replica states."""
        ready, detail = await self.readiness()
        status = {"status": "ok" if ready else "starting", "detail": detail, "model": self._model_name}
        return JSONResponse(status, status_code=200 if ready else 503)

    async def readiness(self) -> tuple[bool, str]:
        checked, ready, detail = self._health
        if time.monotonic() - checked < 1.0:
            return ready, detail
        try:
            app_name = serve.get_replica_context().app_name
            ready, detail = encoder_ready(await asyncio.to_thread(serve.status), app_name)
            if ready:
                ready = bool((await asyncio.wait_for(self.info(), timeout=5)).get("graphs_captured"))
        except Exception as e:  # noqa: BLE001 - not ready is the honest answer when status is unknown
            ready, detail = False, f"status unavailable: {type(e).__name__}: {e}"
        self._health = (time.monotonic(), ready, detail)
        return ready, detail

    def __del__(self):
        # Serve calls this after the replica drained its requests (graceful shutdown).
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
