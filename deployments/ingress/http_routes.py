"""What the ingress's HTTP routes do (`VisionIngress` binds them to `deployments.ingress.openai_api.api`).

`POST /v1/embeddings`: API key (401), drain (503 `shutting_down` with Retry-After while the service shuts down,
`shutdown.DrainWatch`), Content-Type (415), the body (`limits.read_body`: size 413, its own deadline 408) with
its bytes and the headers' held against the replica's byte budget, admission once it has arrived
(`limits.Admission`: 429 at once over `inflight_limit` requests, `max_inflight_bytes` or, once the image
headers are read, `max_inflight_patches`), JSON and schema (400 / 422), the model name (404), image count
(413), pooling and dimensions (400), then the images (`IngressDecoder`: 400 / 413 / 415) and the encoder call
(`EncoderClient`), all under the request's time limit (504; 408 while the body was arriving). Every error is
an OpenAI error object (`openai_api.error_response`). This module parses and answers; admission, decode, the
deadline, the encoder call and the accounting are the request lifecycle's (`lifecycle.Lifecycle`), shared with
the handle calls.
`GET /v1/models`, `GET /health` (`Readiness`: 200 with `status` "ok" or "degraded" while an encoder replica
can serve; 503 "starting", "unavailable" or "draining").
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from deployments.config import AppArgs
from deployments.errors import ErrorCode, RequestError, classify, shown
from deployments.ingress.cache import EncoderCache
from deployments.ingress.decoding import IngressDecoder
from deployments.ingress.encoder_calls import EncoderClient
from deployments.ingress.lifecycle import EmbedOrder, Flight, Lifecycle
from deployments.ingress.limits import Admission, check_content_type, header_bytes, read_body
from deployments.ingress.memory import MemoryTrimmer
from deployments.ingress.openai_api import (
    EmbeddingRequest,
    Items,
    ec_cache_body,
    embeddings_body,
    error_response,
    input_items,
    parse_embedding_request,
)
from deployments.ingress.readiness import Readiness
from deployments.ingress.security import ApiKeyAuth
from deployments.metrics import IngressTelemetry
from deployments.shutdown import DrainWatch

# Bodies above this are parsed off the event loop.
_PARSE_INLINE_BYTES = 256 * 1024
# Answers costing more than this (float32 elements written as JSON text; an element in base64 is counted as
# 1/40 of one) are built in the thread pool. Measured on a CPU of the project machines: 64 x 3,584 float32
# tokens take ~6 ms as JSON text and ~0.1 ms as base64, less than the hand-off to a thread and back.
_ANSWER_INLINE = 65536
# `GET /v1/models` waits at most this long for the encoder's facts (whether it takes text)
_MODELS_INFO_WAIT_S = 2.0


def _parse(raw: bytes) -> tuple[EmbeddingRequest, Items]:
    """The body parsed and its `input` split into images and texts (400 / 422 for either)."""
    parsed = parse_embedding_request(raw)
    return parsed, input_items(parsed.input, parsed.input_type)


def _answer_cost(outputs: list, encoding_format: str) -> float:
    elements = 0
    for o in outputs:
        if isinstance(o, tuple):
            elements += o[0].size * (1 + len(o[1]))
        else:
            elements += o.size
    return elements if encoding_format != "base64" else elements / 40


class HttpRoutes:
    """The bodies of the HTTP routes of one ingress replica (see the module docstring)."""

    def __init__(
        self,
        args: AppArgs,
        client: EncoderClient,
        decoder: IngressDecoder,
        admission: Admission,
        auth: ApiKeyAuth,
        telemetry: IngressTelemetry,
        pool: ThreadPoolExecutor,
        drain: DrainWatch | None = None,
        cache: EncoderCache | None = None,
    ):
        self.args, self._client, self._decoder = args, client, decoder
        self._lifecycle = Lifecycle(args, client, decoder, admission, telemetry, drain, cache)
        self._auth, self._telemetry, self._pool = auth, telemetry, pool
        self._model_name = args.model_name
        self._created = int(time.time())
        draining = (lambda: drain.draining) if drain is not None else (lambda: False)
        self.readiness = Readiness(client.info, args.num_replicas, draining)
        self._trimmer = MemoryTrimmer(pool)

    def _error(self, exc: BaseException) -> tuple[Response, str]:
        """The error answer and its metrics outcome."""
        outcome = classify(exc).error.outcome
        self._telemetry.answered(outcome)
        return error_response(exc, self.args.retry_after_s), outcome

    async def embeddings(self, request: Request) -> Response:
        """The adapter of `POST /v1/embeddings` to the request lifecycle: the API key, then, under the lifecycle,
        the body (its bytes admitted as they arrive, the request slot once it is here), the JSON and its checks
        (model, image count), `Lifecycle.encode`, and the JSON answer; an error becomes an OpenAI error answer."""
        started = time.perf_counter()
        try:
            scope = self._auth.check(request.headers.get("authorization"))  # whose cache uuids these are
        except RequestError as e:
            self._telemetry.request("http", "unauthorized", 0, 0, time.perf_counter() - started)
            return self._error(e)[0]
        if self._lifecycle.refused_draining("http", 0, started):
            return self._error(RequestError("the service is shutting down", ErrorCode.SHUTTING_DOWN, None))[0]
        reading = True

        async def body(flight: Flight) -> Response:
            nonlocal reading
            # bytes first (headers, then the body as it arrives); the request slot only once the body is
            # here, so a slow body holds bytes it sent, never a slot (issue 17)
            flight.reserve_bytes(header_bytes(request))
            check_content_type(request.headers.get("content-type"), request.headers.get("content-encoding"))
            raw = await read_body(
                request, self.args.max_request_bytes, flight.reserve_bytes,
                self.args.body_timeout_s, self.args.body_min_rate,
            )  # fmt: skip
            reading = False
            flight.enter()
            if len(raw) > _PARSE_INLINE_BYTES:
                parsed, items = await asyncio.get_running_loop().run_in_executor(self._pool, _parse, raw)
            else:
                parsed, items = _parse(raw)
            del raw
            flight.n_images = len(items)
            content = await self._embeddings(flight, parsed, items, scope)
            return Response(content=content, media_type="application/json")

        def on_error(e: Exception, flight: Flight, expired: bool) -> tuple[Response, str]:
            if isinstance(e, ClientDisconnect):  # gone before its body arrived (e.g. short of its Content-Length)
                e = RequestError(
                    "the client disconnected before its request body arrived", ErrorCode.INVALID_REQUEST, None
                )
            if isinstance(e, TimeoutError) and expired and reading:  # the body did not arrive in time
                e = RequestError(
                    f"the request body did not arrive within {self.args.request_timeout_s:g}s",
                    ErrorCode.REQUEST_TIMEOUT, None,
                )  # fmt: skip
            return self._error(e)

        return await self._lifecycle.run("http", 0, body, on_error, self._trimmer.trim_after, started)

    async def _embeddings(self, flight: Flight, body: EmbeddingRequest, items: Items, scope: str = "open") -> bytes:
        a = self.args
        if body.model is not None and body.model != self._model_name:
            raise self._unknown_model(body.model)
        if len(items) > a.max_request_images:  # the limit on items: images and texts
            what = "images" if not items.texts else "items" if items.images else "texts"
            raise RequestError(
                f"{len(items)} {what} in one request; the limit is {a.max_request_images}", ErrorCode.TOO_MANY_IMAGES
            )
        # pooling none: the LLM-ready outputs (tokens, DeepStack, patch grid), cast on the replica to the
        # base64 element type (a bfloat16 answer crosses from the replica at half the bytes); the vLLM layout
        # (or files for vLLM's disk connector) implies pooling none
        dtype, layout, pooling = body.embedding_dtype, body.embedding_layout, body.pooling
        uuids = None
        if body.ec_cache_uuids is not None:
            if items.videos:
                raise RequestError("encoder-cache files are of images; this request has video items",
                                   ErrorCode.INVALID_REQUEST, "ec_cache_uuids")  # fmt: skip
            uuids = self._lifecycle.check_ec_cache(body.ec_cache_uuids, len(items.images), bool(items.texts),
                                                   "ec_cache_uuids")  # fmt: skip
            if "embedding_layout" in body.model_fields_set and layout != "vllm":
                raise RequestError(
                    "ec_cache_uuids write the vLLM layout (the tensor vLLM's connector loads); embedding_layout "
                    f"{layout!r} does not apply", ErrorCode.INVALID_LAYOUT, "embedding_layout",
                )  # fmt: skip
            layout = "vllm"
            asked = dtype if "embedding_dtype" in body.model_fields_set else None
            dtype = self._lifecycle.ec_cache_dtype(asked, await self._lifecycle.info())
        if layout == "vllm" and pooling is None:
            pooling = "none"
        order = EmbedOrder(
            items.images, pooling, dtype if pooling == "none" else None, body.dimensions, "input",
            a.max_request_patches, items.texts, items.kinds, layout, videos=list(items.videos), cache=body.cache,
            uuids=getattr(items, "uuids", None), scope=scope,
        )  # fmt: skip
        if uuids is not None:
            written = await self._lifecycle.write_ec_cache(flight, order, uuids)
            flight.phases.update(parse=flight.decode_at - flight.started, answer=0.0)
            return ec_cache_body(written, self._model_name, flight.patches)
        vectors = await self._lifecycle.encode(flight, order)
        answer_at = time.perf_counter()
        # usage.prompt_tokens: the images' and videos' patches and the texts' real tokens (pads not counted)
        args = (vectors, body.encoding_format, self._model_name, flight.patches + flight.text_tokens, dtype)
        if _answer_cost(vectors, body.encoding_format) > _ANSWER_INLINE:  # keep big encodes off the event loop
            content = await asyncio.get_running_loop().run_in_executor(self._pool, embeddings_body, *args)
        else:
            content = embeddings_body(*args)
        flight.phases.update(parse=flight.decode_at - flight.started, answer=time.perf_counter() - answer_at)
        return content

    def _refused(self, request: Request) -> Response | None:
        """The 401 answer when an API key is set and `request` lacks it, else None."""
        try:
            self._auth.check(request.headers.get("authorization"))
        except RequestError as e:
            return self._error(e)[0]
        return None

    def openapi(self, request: Request) -> Response:
        """The OpenAPI schema (behind the API key when one is set: it maps the whole surface)."""
        return self._refused(request) or JSONResponse(request.app.openapi())

    def docs(self, request: Request) -> Response:
        """Swagger UI. With an API key set, the page itself needs the key, and so does the schema it loads
        (a browser cannot send the header: use the schema with curl or a client that sets it)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        root = request.scope.get("root_path", "").rstrip("/")  # the app's route prefix
        return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title=request.app.title)

    async def _input_types(self) -> list[str] | None:
        """What `input` items the served model takes: "image", then "text" (a text side, and not `text=false`)
        and "video" (a Qwen tower: its video processor); None while no encoder replica has answered `describe()`
        (within a few seconds: the listing does not wait for start-up). Asked even with `text=false`: whether the
        model takes video is the replica's to say."""
        try:
            info = await asyncio.wait_for(asyncio.shield(self._client.info()), _MODELS_INFO_WAIT_S)
        except Exception:  # noqa: BLE001 - not started, unavailable: the listing goes without the field
            return None
        text = ["text"] if self.args.text and info.get("text") else []
        video = ["video"] if info.get("video_config") is not None else []
        return ["image", *text, *video]

    async def _model_object(self) -> dict:
        input_types = await self._input_types()
        return {
            "id": self._model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "vision",
            # extension: a preset's seeded random weights embed nothing meaningful; say so
            "random_weights": self.args.random_weights,
            # extension: None, or "fp8" when the towers' block linears run in float8 (AppArgs.quantization)
            "quantization": self.args.quantization,
            # extension: whether the model takes text and video (`input_type` "text" / "video", {"text": ...} /
            # {"video": ...} items); absent while no encoder replica is up
            **({"input_types": input_types} if input_types is not None else {}),
        }

    async def models(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        return JSONResponse({"object": "list", "data": [await self._model_object()]})

    async def model(self, request: Request, model_id: str) -> Response:
        """`GET /v1/models/{id}` (OpenAI's "retrieve model"; ids may hold `/`): the model, or 404."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if model_id != self._model_name:
            return error_response(self._unknown_model(model_id))
        return JSONResponse(await self._model_object())

    def _unknown_model(self, name: str) -> RequestError:
        return RequestError(
            f"model {shown(name)} is not served here; available: {self._model_name!r}",
            ErrorCode.MODEL_NOT_FOUND,
            "model",
        )

    async def health(self) -> JSONResponse:
        """200 while at least one encoder replica can serve (`status` "ok", or "degraded" when some of the
        configured replicas cannot), else 503 ("starting", "unavailable", "draining"). Open without the API
        key (load balancers probe it); it reveals the model name and replica counts."""
        ready, detail = await self.readiness()
        if ready:  # start the decode processes before the first request needs them
            self._decoder.warm((await self._client.info())["preprocess_config"])
        return JSONResponse(detail | {"model": self._model_name}, status_code=200 if ready else 503)
