"""What the ingress's Python handle methods do (`VisionIngress.embed`, `embed_llm` delegate here).

Same path as HTTP without the HTTP parts: admission (a `BackPressureError` at once when this replica is
full: requests, bytes of inputs or patches, `limits.Admission`; 503 while the service shuts down), the images
(`IngressDecoder`) and the encoder call (`EncoderClient`) under the request's time limit (`TimeoutError`).
Bad inputs raise the replica's or the decoder's own `encoder.EncoderError`, never Ray's wrapper; the
per-request limits (images, patches) are HTTP's.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from deployments.config import AppArgs
from deployments.errors import CLIENT_ERROR, DISCONNECTED, OK, classify, root_cause
from deployments.ingress.decoding import IngressDecoder
from deployments.ingress.encoder_calls import EncoderClient
from deployments.ingress.limits import Admission, Ticket
from deployments.llm_outputs import check_dtype
from deployments.metrics import IngressTelemetry
from deployments.shutdown import DrainWatch, ShuttingDownError
from encoder.errors import EncoderError
from encoder.poolings import check_pooling


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
    ):
        self.args, self._client, self._decoder = args, client, decoder
        self._admission, self._telemetry, self._drain = admission, telemetry, drain

    async def __call__(self, images, pooling: str | None, llm: str | None) -> list:
        """Per image a pooled vector (`llm` None) or a `WireLLM` tuple in the wire dtype `llm`."""
        started = time.perf_counter()
        telemetry = self._telemetry
        if not isinstance(images, list | tuple):
            images = [images]
        if self._drain is not None and not self._drain.admitting():  # shutting down: 503, come back elsewhere
            telemetry.request("handle", "overloaded", len(images), 0, time.perf_counter() - started)
            raise ShuttingDownError(retry_after_s=self.args.retry_after_s)
        admission, ticket = self._admission, Ticket()
        outcome, n_images, patches = CLIENT_ERROR, len(images), 0
        try:
            admission.reserve_bytes(ticket, sum(_nbytes(x) for x in images))
            admission.enter(ticket)
            if pooling is not None:
                check_pooling(pooling)
            if llm is not None:
                check_dtype(llm)
            if not images:
                outcome = OK
                return []
            async with asyncio.timeout(self.args.request_timeout_s):
                info = await self._client.info()
                pooling = pooling or info["default_pooling"]
                decode_at = time.perf_counter()
                reserve = partial(admission.reserve_patches, ticket)
                arrays = await self._decoder.prepare(list(images), info["preprocess_config"], "images", None, reserve)
                encode_at = time.perf_counter()
                deadline = time.time() + self.args.request_timeout_s - (time.perf_counter() - started)
                vectors, patches = await self._client.encode(arrays, pooling, llm, deadline)
            outcome = OK
            done = time.perf_counter()
            telemetry.timings["handle"].add(total=done - started, decode=encode_at - decode_at, encode=done - encode_at)
            return vectors
        except EncoderError as e:
            raise root_cause(e) from None  # the replica's own exception, not Ray's wrapper
        except asyncio.CancelledError:  # the caller cancelled its call (or went away)
            outcome = DISCONNECTED
            raise
        except Exception as e:
            outcome = classify(e).error.outcome
            raise
        finally:
            admission.leave(ticket)
            telemetry.request("handle", outcome, n_images, patches, time.perf_counter() - started)
