"""The ingress (CPU): OpenAI-compatible HTTP API and the Python handle API.

Per request: validate (pydantic), decode base64 / data URLs, decode and resize each image to uint8 at
its smart_resize size in a thread pool (`load_image` + `resize_image`), count patches, and send the
compact uint8 arrays to an encoder replica with `encode_pixels(pixels, pooling=..., num_patches=n)`.
Optionally (`ingress_batch_size` > 1) calls arriving within `ingress_batch_wait_timeout_s` are merged
into one encoder request, so many one-image clients cost the encoder replica one Serve request.
The request schema, decoding and error mapping are in `deployments.openai_api`.
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
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from encoder.api import check_pooling
from encoder.errors import EncoderError
from encoder.preprocess import PreprocessConfig

from .config import ENCODER_NAME, AppArgs
from .metrics import IngressMetrics
from .openai_api import (
    EmbeddingRequest,
    RequestError,
    api,
    classify,
    embeddings_body,
    prepare_image,
    root_cause,
    with_index,
)

logger = logging.getLogger("ray.serve")


# ------------------------------------------------------------------------------------------ deployment
# Helpers the deployment class uses are defined above it: Serve serialises the class when decorated.


def encoder_ready(status, app_name: str) -> tuple[bool, str]:
    """Whether `serve.status()` shows every target encoder replica of the app running.

    A replica is RUNNING only after its constructor returned, and the constructor captures every
    bucket graph, so HEALTHY (running == target, health checks passing) means all graphs are captured.
    """
    app = status.applications.get(app_name)
    dep = app.deployments.get(ENCODER_NAME) if app is not None else None
    if dep is None:
        return False, f"deployment {ENCODER_NAME} not found in application {app_name!r}"
    running = sum(n for state, n in dep.replica_states.items() if state == "RUNNING")
    state = getattr(dep.status, "value", dep.status)
    return state == "HEALTHY" and running > 0, f"{ENCODER_NAME}: {state}, {running} replica(s) running"


@dataclass
class Call:
    """One caller's images waiting to be merged with others into an encoder request."""

    arrays: list[np.ndarray]
    counts: list[int]
    pooling: str


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


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api)
class VisionIngress:
    """HTTP routes (`/v1/embeddings`, `/v1/models`, `/health`) and the handle method `embed`."""

    def __init__(self, encoder: DeploymentHandle, args: dict):
        self.args = a = AppArgs.model_validate(args)
        self._encoder = encoder
        self._model_name = a.model_name
        self._pool = ThreadPoolExecutor(a.decode_threads, thread_name_prefix="decode")
        self._info: dict | None = None
        self._info_lock = asyncio.Lock()
        self._health: tuple[float, bool, str] = (0.0, False, "")
        self._created = int(time.time())
        self.metrics = IngressMetrics()
        self._counts = {"merged_calls": 0, "merged_batches": 0, "encoder_requests": 0}
        self._merge = None
        if a.ingress_batch_size > 1:
            self._merge = serve.batch(
                max_batch_size=a.ingress_batch_size,
                batch_wait_timeout_s=a.ingress_batch_wait_timeout_s,
                max_concurrent_batches=a.ingress_max_concurrent_batches,
                batch_size_fn=lambda calls: sum(len(c.arrays) for c in calls),
            )(self._run_merged)

    # -- facts from the encoder replicas ------------------------------------------------------------------
    async def info(self) -> dict:
        """The encoder's `describe()` (model, out_dim, preprocessing, batch limits), fetched once."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    info = await self._encoder.describe.remote()
                    info["preprocess_config"] = PreprocessConfig.model_validate(info["preprocess"])
                    self._info = info
        return self._info

    # -- the shared path ------------------------------------------------------------------------------------
    async def _prepare(self, images: list, pp: PreprocessConfig, label: str) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()

        def one(i: int, x: Any) -> np.ndarray:
            try:
                return prepare_image(x, pp)
            except EncoderError as e:
                raise with_index(e, f"{label}[{i}]") from None

        if len(images) == 1:
            return [await loop.run_in_executor(self._pool, one, 0, images[0])]
        return list(await asyncio.gather(*(loop.run_in_executor(self._pool, one, i, x) for i, x in enumerate(images))))

    async def _encode(self, arrays: list[np.ndarray], pooling: str) -> tuple[list[np.ndarray], int]:
        info = await self.info()
        p = info["preprocess_config"].patch_size
        counts = [(x.shape[0] // p) * (x.shape[1] // p) for x in arrays]
        if self._merge is not None and len(arrays) < self.args.ingress_batch_size:
            self._counts["merged_calls"] += 1
            return await self._merge(Call(arrays, counts, pooling)), sum(counts)
        return await self._send(arrays, counts, pooling), sum(counts)

    async def _send(self, arrays: list[np.ndarray], counts: list[int], pooling: str) -> list[np.ndarray]:
        info = await self.info()
        parts = chunk(counts, info["max_batch_patches"], info["max_batch_images"])
        calls = [
            self._encoder.encode_pixels.remote(arrays[s:e], pooling=pooling, num_patches=sum(counts[s:e]))
            for s, e in parts
        ]
        self._counts["encoder_requests"] += len(calls)
        if len(calls) == 1:
            return await calls[0]
        return [v for part in await asyncio.gather(*calls) for v in part]

    async def _run_merged(self, calls: list[Call]) -> list[list[np.ndarray]]:
        self._counts["merged_batches"] += 1
        out: list[list[np.ndarray] | None] = [None] * len(calls)
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(calls):
            groups.setdefault(c.pooling, []).append(i)

        async def run(pooling: str, members: list[int]) -> None:
            arrays = [x for i in members for x in calls[i].arrays]
            counts = [n for i in members for n in calls[i].counts]
            self.metrics.merged.observe(len(arrays))
            vectors = await self._send(arrays, counts, pooling)
            pos = 0
            for i in members:
                out[i] = vectors[pos : pos + len(calls[i].arrays)]
                pos += len(calls[i].arrays)

        await asyncio.gather(*(run(p, m) for p, m in groups.items()))
        return out

    def ingress_stats(self) -> dict:
        """Counters of this ingress replica: calls through the merger, merged batches, encoder requests."""
        return dict(self._counts)

    # -- Python handle API ------------------------------------------------------------------------------------
    async def embed(self, images, pooling: str = "mean") -> list[np.ndarray]:
        """Embeddings of `images` (a list of encoded bytes, PIL images, uint8 arrays, data URLs or base64
        strings; a single image is treated as a list of one): per image a float32 array, [out_dim] for
        pooling="mean", [tokens, out_dim] for "none". Raises `encoder.EncoderError` subclasses for bad
        inputs (the message names the position, e.g. "images[3]: ...")."""
        started = time.perf_counter()
        if not isinstance(images, list | tuple):
            images = [images]
        outcome, n_images, patches = "client_error", len(images), 0
        try:
            check_pooling(pooling)
            if not images:
                outcome = "ok"
                return []
            info = await self.info()
            arrays = await self._prepare(list(images), info["preprocess_config"], "images")
            vectors, patches = await self._encode(arrays, pooling)
            outcome = "ok"
            return vectors
        except EncoderError as e:
            raise root_cause(e) from None  # the replica's own exception, not Ray's wrapper
        except Exception:
            outcome = "server_error"
            raise
        finally:
            self.metrics.request("handle", outcome, n_images, patches, time.perf_counter() - started)

    # -- HTTP ------------------------------------------------------------------------------------------------
    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest) -> Response:
        started = time.perf_counter()
        inputs = [body.input] if isinstance(body.input, str) else body.input
        outcome, patches = "client_error", 0
        try:
            if body.model is not None and body.model != self._model_name:
                raise RequestError(
                    f"model {body.model!r} is not served here; available: {self._model_name!r}", 404,
                    "model_not_found", "model",
                )  # fmt: skip
            if len(inputs) > self.args.max_request_images:
                raise RequestError(
                    f"{len(inputs)} images in one request; the limit is {self.args.max_request_images}",
                    413, "too_many_images",
                )  # fmt: skip
            info = await self.info()
            if body.dimensions is not None and body.dimensions != info["out_dim"]:
                raise RequestError(
                    f"dimensions={body.dimensions} is not supported; this model outputs {info['out_dim']}",
                    param="dimensions", code="invalid_dimensions",
                )  # fmt: skip
            arrays = await self._prepare(inputs, info["preprocess_config"], "input")
            vectors, patches = await self._encode(arrays, body.pooling)
            size = sum(v.size for v in vectors)
            args = (vectors, body.encoding_format, self._model_name, patches)
            if size > 65536:  # keep big JSON encodes off the event loop
                content = await asyncio.get_running_loop().run_in_executor(self._pool, embeddings_body, *args)
            else:
                content = embeddings_body(*args)
            outcome = "ok"
            return Response(content=content, media_type="application/json")
        except Exception as e:
            outcome = "client_error" if classify(e)[0] < 500 else "server_error"
            raise
        finally:
            self.metrics.request("http", outcome, len(inputs), patches, time.perf_counter() - started)

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self._model_name, "object": "model", "created": self._created, "owned_by": "vision"}],
        }

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once every encoder replica of this application is running (constructed = graphs captured)."""
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
