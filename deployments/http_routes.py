"""What the ingress's HTTP routes do (`VisionIngress` binds them to `deployments.openai_api.api`).

`POST /v1/embeddings`: API key (401), admission (429 at once when this replica has `inflight_limit`
requests in flight), Content-Type (415) and body size (413), JSON and schema (400 / 422), the model name
(404), image count (413), pooling and dimensions (400), then the images (`IngressDecoder`: 400 / 413 /
415) and the encoder call (`EncoderClient`), all under the request's time limit (504; 408 while the body
was still arriving). Every error is an OpenAI error object (`openai_api.error_response`).
`GET /v1/models`, `GET /health` (`Readiness`).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .config import AppArgs
from .decoding import IngressDecoder
from .encoder_calls import EncoderClient
from .errors import ErrorCode, RequestError, classify
from .limits import Admission, check_content_type, read_body
from .metrics import IngressTelemetry
from .openai_api import EmbeddingRequest, embeddings_body, error_response, parse_embedding_request
from .readiness import Readiness
from .security import ApiKeyAuth

# Bodies above this are parsed off the event loop.
_PARSE_INLINE_BYTES = 256 * 1024
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
    ):
        self.args, self._client, self._decoder, self._admission = args, client, decoder, admission
        self._auth, self._telemetry, self._pool = auth, telemetry, pool
        self._model_name = args.model_name
        self._created = int(time.time())
        self.readiness = Readiness(client.info)

    def _error(self, exc: BaseException) -> tuple[Response, str]:
        """The error answer and its metrics outcome."""
        outcome = classify(exc).error.outcome
        self._telemetry.answered(outcome)
        return error_response(exc, self.args.retry_after_s), outcome

    async def embeddings(self, request: Request) -> Response:
        started = time.perf_counter()
        telemetry = self._telemetry
        try:
            self._auth.check(request.headers.get("authorization"))
        except RequestError as e:
            telemetry.request("http", "unauthorized", 0, 0, time.perf_counter() - started)
            return self._error(e)[0]
        if not self._admission.try_enter():
            telemetry.request("http", "overloaded", 0, 0, time.perf_counter() - started)
            return self._error(self._admission.overloaded(self.args.retry_after_s))[0]
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
            telemetry.request("http", "ok", n_images, patches, time.perf_counter() - started)
            return Response(content=content, media_type="application/json")
        except Exception as e:
            if isinstance(e, TimeoutError) and timer.expired():
                if reading:  # the client did not finish sending its body in time
                    e = RequestError(
                        f"the request body did not arrive within {self.args.request_timeout_s:g}s",
                        ErrorCode.REQUEST_TIMEOUT, None,
                    )  # fmt: skip
            response, outcome = self._error(e)
            telemetry.request("http", outcome, n_images, patches, time.perf_counter() - started)
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
        info = await self._client.info()
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
        arrays = await self._decoder.prepare(inputs, info["preprocess_config"], "input", a.max_request_patches)
        encode_at = time.perf_counter()
        # pooling none: the LLM-ready outputs (tokens, DeepStack, patch grid), cast on the replica to the
        # base64 element type (a bfloat16 answer crosses from the replica at half the bytes)
        dtype = body.embedding_dtype
        llm = dtype if pooling == "none" else None
        vectors, patches = await self._client.encode(arrays, pooling, llm)
        answer_at = time.perf_counter()
        del arrays
        args = (vectors, body.encoding_format, self._model_name, patches, dtype)
        if _answer_cost(vectors, body.encoding_format) > _ANSWER_INLINE:  # keep big encodes off the event loop
            content = await asyncio.get_running_loop().run_in_executor(self._pool, embeddings_body, *args)
        else:
            content = embeddings_body(*args)
        done = time.perf_counter()
        self._telemetry.timings["http"].add(
            total=done - started, parse=decode_at - started, decode=encode_at - decode_at,
            encode=answer_at - encode_at, answer=done - answer_at,
        )  # fmt: skip
        return content, patches

    def models(self, request: Request) -> Response:
        try:
            self._auth.check(request.headers.get("authorization"))
        except RequestError as e:
            return self._error(e)[0]
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self._model_name,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "vision",
                        # extension: a preset's seeded random weights embed nothing meaningful; say so
                        "random_weights": self.args.random_weights,
                    }
                ],
            }
        )

    async def health(self) -> JSONResponse:
        """200 once every encoder replica of this application is running (constructed = graphs captured).
        Open without the API key (load balancers probe it); it reveals the model name and replica states."""
        ready, detail = await self.readiness()
        status = {"status": "ok" if ready else "starting", "detail": detail, "model": self._model_name}
        return JSONResponse(status, status_code=200 if ready else 503)
