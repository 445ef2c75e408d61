"""The ingress deployment (CPU): the OpenAI-compatible HTTP API and the Python handle API, wired together.

`VisionIngress` only connects the parts of one ingress replica; each part is its own module:

* `http_routes.HttpRoutes`: what `POST /v1/embeddings`, `GET /v1/models` and `GET /health` do; the request
  schema, answer bodies and error answers are `openai_api`'s, which status an error gets `errors`'.
* `handle_calls.HandleCalls`: what `embed`, `embed_llm` and `embed_text` do.
* `lifecycle.Lifecycle`: what both do with a parsed request (admission, pooling, decode, deadline, encoder
  call, accounting), written once.
* `decoding.IngressDecoder`: header checks, the request's patch total, then decode and resize to uint8
  (`inputs`), on the event loop or in this replica's thread pool.
* `encoder_calls.EncoderClient`: merging callers into encoder requests, splitting big ones, retries (the
  record sent is `deployments.wire.EncodeRequest`).
* `limits.Admission`, `security.ApiKeyAuth` / `UrlFetcher`, `metrics.IngressTelemetry`.
"""

# No `from __future__ import annotations` here: FastAPI must see the request class itself in the route
# signatures of the Serve ingress class.
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppArgs
from deployments.ingress.cache import EncoderCache
from deployments.ingress.decoding import IngressDecoder
from deployments.ingress.encoder_calls import EncoderClient
from deployments.ingress.handle_calls import HandleCalls
from deployments.ingress.http_routes import HttpRoutes
from deployments.ingress.inputs import harden_pillow
from deployments.ingress.limits import Admission
from deployments.ingress.openai_api import EmbeddingRequest, api
from deployments.ingress.security import ApiKeyAuth, UrlFetcher
from deployments.llm_outputs import handle_item, video_facts
from deployments.metrics import IngressTelemetry, rss_bytes
from deployments.ray_compat import check_ray, describe_request_path, quiet_serve_noise
from deployments.shutdown import DrainWatch

logger = logging.getLogger("ray.serve")
_OPENAPI_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": EmbeddingRequest.model_json_schema(ref_template="#/$defs/{model}")}},
    }
}


def vllm_item(wire) -> dict:
    """The handle's per-item dict of the vLLM layout: `{"embeds", "grid_thw"}`, a video's facts too
    (`llm_outputs.video_facts`: `"timestamps"` or `"second_per_grid_ts"`)."""
    return {"embeds": wire[0], "grid_thw": list(wire[2])} | video_facts(wire)


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api)
class VisionIngress:
    """HTTP routes (`/v1/embeddings`, `/v1/models`, `/health`) and the handle methods `embed`, `embed_llm`,
    `write_ec_cache`, `embed_text`."""

    def __init__(self, encoder: DeploymentHandle, args: dict):
        check_ray()
        quiet_serve_noise()  # before the encoder handle's first use logs its router's repr
        self.args = a = AppArgs.model_validate(args)
        harden_pillow(a.max_image_pixels)
        self._pool = ThreadPoolExecutor(a.decode_threads, thread_name_prefix="decode")
        self.telemetry = IngressTelemetry()
        self._admission = Admission(a.inflight_limit, a.max_inflight_bytes, a.max_inflight_patches, a.retry_after_s)
        auth, urls = ApiKeyAuth.from_args(a), UrlFetcher.from_args(a)
        self._client = EncoderClient(encoder, a, self.telemetry)
        self._decoder = decoder = IngressDecoder(
            self._pool, urls, a.max_image_bytes, self.telemetry.timings["inline_decode"],
            a.decode_processes, a.decode_timeout_s,
        )  # fmt: skip
        replica_id = serve.get_replica_context().replica_id.unique_id
        # the drain waits for admitted requests and for bodies still arriving (they hold bytes, not a slot)
        self._drain = DrainWatch(
            replica_id, lambda: self._admission.inflight + (self._admission.bytes > 0), grace_s=a.drain_grace_s
        )
        parts = (self._client, decoder, self._admission)
        # encoder outputs by content, shared by both ways in (None: cache_mib 0, off)
        self._cache = EncoderCache(a.cache_mib * 2**20, self.telemetry) if a.cache_mib else None
        self._http = HttpRoutes(a, *parts, auth, self.telemetry, self._pool, self._drain, self._cache)
        self._handle = HandleCalls(a, *parts, self.telemetry, self._drain, self._cache)
        logger.info(
            "vision ingress: API key %s, URL fetching %s, %d requests in flight at most, %gs per request, %s",
            "required" if auth.enabled else "off",
            f"from {', '.join(a.url_allowlist)}" if urls.enabled else "off",
            a.inflight_limit, a.request_timeout_s,
            # this replica's environment is what Serve read in it; build_app's line has the longer hint
            describe_request_path(hint="docs/service.md#fast-request-path"),
        )  # fmt: skip

    # -- Python handle API ------------------------------------------------------------------------------------
    async def embed(
        self, images=None, pooling: str | None = None, cache: bool = True, cache_uuids=None, *, videos=None
    ) -> list[np.ndarray]:
        """Embeddings of `images` (a list of encoded bytes, PIL images, uint8 arrays, data URLs or base64
        strings; a single image is treated as a list of one): per image a float32 array, [out_dim] for
        pooling="mean", [tokens, out_dim] for "none". Raises `encoder.EncoderError` subclasses for bad
        inputs (the message names the position, e.g. "images[3]: ..."), `ray.serve.exceptions.BackPressureError`
        when the service is over capacity and `TimeoutError` past `request_timeout_s`. The per-image limits
        (encoded bytes, pixels, formats) apply; the per-request ones (images, patches) are HTTP's.

        With the encoder cache on (`cache_mib`): `cache=False` bypasses it; `cache_uuids`, per image a key of the
        caller's own (or None: its content is hashed), the same key always for the same image; handle callers share
        one scope of keys, apart from HTTP's (docs/service.md#encoder-cache).

        `videos` (Qwen towers): encoded videos (MP4 / MOV, WebM / Matroska, AVI as bytes, a data URL or base64) or
        uint8 arrays [frames, H, W, 3] of every frame (taken at 24 fps), sampled and resized as the checkpoint's
        video processor within its limits (`describe()["video"]["limits"]`); their outputs follow the images',
        in order: pooling="mean" is one vector per video. Videos bypass the encoder cache (always decoded and
        encoded). A bad video raises the encoder's error naming it ("videos[1]: ..."): `VideoDecodeError`,
        `InvalidVideoError`, `VideoTooLargeError`, `DecodeTimeoutError`; a tower without video a `RequestError`
        (code `video_not_supported`)."""
        return await self._handle(images, pooling, None, videos=videos, cache=cache, cache_uuids=cache_uuids)

    async def embed_llm(
        self,
        images=None,
        dtype: str | None = "float32",
        layout: str = "parts",
        cache: bool = True,
        cache_uuids=None,
        *,
        videos=None,
    ) -> list[dict]:
        """What a VLM's LLM needs in place of its vision tower, per image (inputs, limits and errors as `embed`):
        `{"tokens": [n, out_dim], "deepstack": [[n, out_dim] per DeepStack layer, model order; [] for towers
        without], "grid_thw": [t, h, w]}` (the patch grid, as the Hugging Face processor's `image_grid_thw`).
        The arrays are float32, or with `dtype="float16"` np.float16, with `dtype="bfloat16"` np.uint16 holding
        bfloat16 bit patterns (`torch.from_numpy(x).view(torch.bfloat16)`); both halve what crosses processes.
        `dtype=None` is float32. `layout="vllm"` (Qwen towers): per image `{"embeds": [n, out_dim * (1 + L)],
        "grid_thw": [t, h, w]}`, the tokens and the L DeepStack layers concatenated on the last axis in model
        order, the one tensor vLLM's Qwen models produce per image and take as `image_embeds`
        (docs/llm-handoff.md); another tower is refused (`RequestError`, code `invalid_layout`). `cache`,
        `cache_uuids`: as `embed`'s.
        `videos` as `embed`, after the images: a video's `grid_thw` has t > 1 (its temporal patches) and, for
        Qwen3-VL, `"timestamps"`: seconds per temporal patch, as the processor puts them in the prompt; for
        Qwen2/2.5-VL, `"second_per_grid_ts"`: the seconds one temporal patch spans (a float), which Qwen2.5-VL's
        M-RoPE steps the video's temporal positions by (vLLM's `second_per_grid_ts` of the video)."""
        wires = await self._handle(
            images, "none", dtype or "float32", layout, videos=videos, cache=cache, cache_uuids=cache_uuids
        )
        if layout == "vllm":
            return [vllm_item(w) for w in wires]
        return [handle_item(w) for w in wires]

    async def write_ec_cache(
        self, images, uuids, dtype: str | None = None, cache: bool = True, cache_uuids=None
    ) -> list[dict]:
        """Encode `images` and write each one's vLLM-layout tensor where vLLM's disk encoder-cache connector
        (`ECExampleConnector`, `shared_storage_path` = this service's `ec_cache_dir`) reads the encoder output of
        `mm_hash` = its uuid: `<ec_cache_dir>/<uuids[i]>/encoder_cache.safetensors`, key `ec_cache`, atomically.
        `uuids`: one per image, what the client will send vLLM as the item's `uuid`; letters, digits, `.`, `_`,
        `-`, `:`, not starting with `.`, distinct. `dtype`: the tensor's (None: the tower's own, bfloat16 on a
        GPU). Per image `{"object": "ec_cache", "index", "uuid", "path", "shape", "dtype", "grid_thw"}`. Raises
        `RequestError` (codes `ec_cache_not_configured`, `invalid_uuid`, `invalid_layout`) and as `embed`. `cache`,
        `cache_uuids`: as `embed`'s (the encoder cache; a hit still writes its file)."""
        return await self._handle.ec_cache(images, uuids, dtype, cache, cache_uuids)

    async def embed_text(self, texts, pooling: str | None = None, cache: bool = True) -> list[np.ndarray]:
        """Embeddings of `texts` (a list of non-empty strings; one string is a list of one), for a model with a
        text tower (CLIP, SigLIP2 with their tokenizer files): per text a float32 array [out_dim], in the image
        embeddings' space. `pooling`: "model" (None: the model's text embedding) or "model-l2". A text longer than
        the tower's length is cut as the model's tokenizer cuts it. Raises `encoder.EncoderError` subclasses as
        `embed` does: an empty or non-string text (naming `texts[i]`), a model without text
        (`deployments.errors.RequestError`, code `text_not_supported`), an image-only pooling; over capacity and
        time limit as `embed`. `cache=False` bypasses the encoder cache (texts are keyed by their string)."""
        return await self._handle.text(texts, pooling, cache)

    async def info(self) -> dict:
        """The encoder's `describe()` as this ingress uses it (its preprocessing carries the decode limits)."""
        return await self._client.info()

    def ingress_stats(self) -> dict:
        """Counters of this ingress replica: calls through the merger, merged batches, encoder requests and
        retries, rejections, timeouts, errors; what is in flight (requests now, peak, limit; bytes; patches),
        resident memory and pid, the decode processes' pids and the medians of the last requests' phases."""
        snapshot = self.telemetry.snapshot()
        timings = snapshot.pop("timings_ms")
        return (
            snapshot
            | self._admission.snapshot()
            | {
                "rss_bytes": rss_bytes(),
                "pid": os.getpid(),
                "decode_pids": self._decoder.pids(),
                "replica_id": serve.get_replica_context().replica_id.unique_id,
                "timings_ms": timings,
                # the encoder cache: entries, bytes, max_bytes, evictions (None: off)
                "cache": self._cache.snapshot() if self._cache is not None else None,
            }
        )

    # -- HTTP ------------------------------------------------------------------------------------------------
    @api.post("/v1/embeddings", openapi_extra=_OPENAPI_BODY)
    async def embeddings(self, request: Request) -> Response:
        return await self._http.embeddings(request)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._http.models(request)

    @api.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> Response:
        return await self._http.model(request, model_id)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> Response:
        return self._http.openapi(request)

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        return self._http.docs(request)

    @api.api_route("/health", methods=["GET", "HEAD"])  # HEAD: the probe of some load balancers
    async def health(self) -> JSONResponse:
        """200 while at least one encoder replica can serve ("ok" / "degraded"), else 503. Open without the
        API key (load balancers probe it); it reveals the model name and replica counts."""
        return await self._http.health()

    async def readiness(self) -> tuple[bool, dict]:
        return await self._http.readiness()

    def __del__(self):
        # Serve calls this after the replica drained its requests (graceful shutdown).
        drain = getattr(self, "_drain", None)
        if drain is not None:
            drain.stop()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        decoder = getattr(self, "_decoder", None)
        if decoder is not None:
            decoder.close()
