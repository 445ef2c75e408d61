"""How the ingress calls the encoder replicas: request merging, splitting and retries.

`EncoderClient.encode(arrays, pooling, llm)` sends resized uint8 images to the encoder deployment with
`encode_pixels(pixels, pooling=..., num_patches=n, num_images=k)` (pooled vectors) or `encode_llm_pixels(pixels,
dtype=..., num_patches=n, num_images=k)` (per-token LLM-ready outputs in a wire dtype); `encode_texts(texts,
pooling)` sends texts with `encode_texts(texts, pooling=..., num_tokens=n, num_texts=k)` (`wire.TextRequest`:
tokens are the text tower's fixed length per text). Both go through the same machinery, text and image records
never in one call (`wire.group`):

* merging (`ingress_batch_size` > 1): calls that arrive while `ingress_max_concurrent_batches` merged
  requests are in flight wait and go together in the next one (no timer: an idle call goes out at once),
  so many one-image clients cost the encoder replica few Serve requests;
* splitting: a request above the encoder's batch limits goes as several calls (`chunk`, "packs"), at most
  `ingress_packs_in_flight` of them at once, so other callers' requests interleave with a large one;
* cancelling: a call given up (deadline, client gone, a sibling pack failed) is cancelled at the encoder
  too (`StallWatch.call`, as `aio.await_cancelling` does), and a request's packs not yet sent are not sent;
* retries: a call whose replica died or is unavailable is retried with backoff (encoding is idempotent);
* hung replicas (`routing.progress`): a call waiting on a replica that made no progress for
  `replica_stall_timeout_s` is cancelled there and retried on another (`StallWatch`), and while no replica makes
  progress a call is not sent at all: it fails at once (`ReplicaStalledError`, 503 `encoder_unavailable` once the
  retries are spent) instead of waiting out the request's deadline;
* transport: a call goes by reference (Ray's object store, as a Ray actor task) when its pixels exceed 2 MiB
  or its answer is expected to exceed 256 KiB (`answer_bytes`: per-token outputs), else inline over gRPC
  in Ray's throughput mode. Over gRPC the encoder replica pickles each answer into its response message on
  its event loop, which also runs the batching: with bfloat16 answers of ~3 224x224 images (1.4 MB) per
  call that loop held the GIL 55% of the time (26 points in native code under the loop: uvloop, gRPC),
  the GPU was busy 63% and the answers ran at 81% of the pooled ones (py-spy on the H200, docs/journal/benchmarks.md,
  issue 14). By reference, Ray serialises the answer off that loop (numpy buffers out of band, into shared
  memory) and the ingress reads the arrays in place: GPU 89% busy, 93-96% of the pooled throughput.

`info()` is the encoder's `describe()`, fetched once, with the application's decode limits wired into its
preprocessing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deployments.aio import gather_or_cancel
from deployments.batching import ContinuousBatcher
from deployments.config import AppArgs
from deployments.errors import UNAVAILABLE_ERRORS
from deployments.ingress.inputs import ingress_preprocess_config
from deployments.llm_outputs import wire_itemsize
from deployments.metrics import IngressTelemetry
from deployments.ray_compat import by_reference, call_with_request_id, new_request_id
from deployments.routing.progress import ReplicaProgress, ReplicaStalledError, no_progress_message, progress_for
from deployments.wire import EncodeRequest, TextRequest, group, patch_count
from encoder.preprocessing.families import preprocess_config_from_dump
from encoder.preprocessing.video import VideoPreprocessConfig

logger = logging.getLogger("ray.serve")
T = TypeVar("T")

# Encoder requests with more pixel bytes than this, or answers expected above _INLINE_ANSWER_BYTES, go by
# reference (object store), not inline over gRPC (see the module docstring).
_INLINE_BYTES = 2 * 2**20
_INLINE_ANSWER_BYTES = 256 * 2**10


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


def batch_limits(info: dict, request: EncodeRequest | TextRequest) -> tuple[int, int]:
    """(patches or tokens, images or texts) one encoder call of this kind may carry: the replica's batch limits."""
    if isinstance(request, TextRequest):
        text = info["text"]
        return text["max_batch_texts"] * text["seq_len"], text["max_batch_texts"]
    return info["max_batch_patches"], info["max_batch_images"]


def answer_bytes(info: dict, counts: list[int], pooling: str, llm: str | None) -> int:
    """The bytes of an encoder call's answer for images of `counts` patches: per image a pooled vector, a
    float32 token matrix (`pooling="none"`) or the LLM-ready outputs in the wire dtype `llm` (tokens and
    each DeepStack layer). `info`: the encoder's `describe()` (`EncoderClient.info`)."""
    if llm is None and pooling != "none":
        return 4 * len(counts) * info["output_dims"].get(pooling, info["out_dim"])
    m = info["preprocess_config"].merge_size
    tokens = sum(c // (m * m) for c in counts)
    if llm is None:
        return 4 * tokens * info["output_dims"].get("none", info["out_dim"])
    return wire_itemsize(llm) * tokens * info["out_dim"] * (1 + info["deepstack_layers"])


def backoff_s(attempt: int, base_s: float, cap_s: float = 2.0) -> float:
    """Delay before retry `attempt` (1-based): base * 2^(attempt-1), capped, with +-50% jitter."""
    return min(cap_s, base_s * 2 ** (attempt - 1)) * (0.5 + random.random())


# what a replica raising proves: it ran the call (an answer of its own), unlike these, which come from Ray or this
# process (the replica died or was unreachable; the call was cancelled)
_NOT_ANSWERED = (*UNAVAILABLE_ERRORS, asyncio.CancelledError)


class StallWatch:
    """Encoder calls followed to their replica (`routing.progress`): `await watch.call(method, *args, **kwargs)` is
    `call_as_new_request(method, ...)` that raises `ReplicaStalledError` instead of waiting on once its replica is
    judged stalled (or, not yet given to one, once none makes progress), after cancelling the call there. One
    ticker task checks every waiting call every `stall_timeout_s / 8` (at most 0.25 s) while any waits."""

    def __init__(self, progress: ReplicaProgress):
        self.progress = progress
        self._waiting: dict[str, asyncio.Future] = {}  # call id -> set to the error when its call is given up
        self._ticker: asyncio.Task | None = None

    def unavailable(self) -> ReplicaStalledError | None:
        """The error a call sent now would end in, when no replica makes progress."""
        progress = self.progress
        if progress.no_progress():
            return ReplicaStalledError(no_progress_message(progress.replica_count(), progress.stall_timeout_s))
        return None

    async def call(self, method, *args, **kwargs):
        error = self.unavailable()
        if error is not None:
            raise error
        call_id = new_request_id()
        self.progress.begin(call_id)
        given_up = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = given_up
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        response = call_with_request_id(call_id, method, *args, **kwargs)
        answer = asyncio.ensure_future(response)
        answered = False
        try:
            await asyncio.wait((answer, given_up), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                raise given_up.result()
            try:
                result = answer.result()
            except _NOT_ANSWERED:
                raise
            except BaseException:
                answered = True  # the replica's own error (a bad input, its deadline): it is running
                raise
            answered = True
            return result
        finally:
            del self._waiting[call_id]
            given_up.cancel()
            if not answer.done():
                # give up before cancelling: the cancellation is not the replica's answer (`progress.end`)
                self.progress.end(call_id, answered=False)
                response.cancel()
                answer.cancel()
            else:
                self.progress.end(call_id, answered=answered)

    async def _tick(self) -> None:
        while self._waiting:
            await asyncio.sleep(min(0.25, self.progress.stall_timeout_s / 8))
            for call_id, given_up in list(self._waiting.items()):
                if given_up.done():
                    continue
                error = self.progress.verdict(call_id)
                if error is not None:
                    given_up.set_result(error)


async def call_with_retries(
    call: Callable[[], Awaitable[T]],
    retries: int,
    base_s: float,
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> T:
    """`await call()`, again (at most `retries` times, with backoff) when it fails with an unavailable-replica
    error. Only for idempotent calls. Other errors (the request's own, backpressure) propagate at once."""
    attempt = 0
    while True:
        try:
            return await call()
        except UNAVAILABLE_ERRORS as e:
            if attempt >= retries:
                raise
            attempt += 1
            if on_retry is not None:
                on_retry(e, attempt)
            await asyncio.sleep(backoff_s(attempt, base_s))


class EncoderClient:
    """The ingress replica's side of the encoder deployment (see the module docstring)."""

    def __init__(self, encoder: DeploymentHandle, args: AppArgs, telemetry: IngressTelemetry):
        self.args = args
        self._encoder = encoder
        # Big payloads go through Ray's object store (shared memory on one node, no gRPC message cap) even
        # when Serve sends requests over gRPC (RAY_SERVE_THROUGHPUT_OPTIMIZED=1); small ones stay inline.
        self._encoder_by_ref = by_reference(encoder)
        self._telemetry = telemetry
        self._info: dict | None = None
        self._info_lock = asyncio.Lock()
        progress = progress_for(encoder.app_name)
        progress.configure(args.replica_stall_timeout_s)
        self._watch = StallWatch(progress)
        self._merge = None
        if args.ingress_batch_size > 1:
            limit = args.ingress_batch_size
            self._merge = ContinuousBatcher(
                self._run_merged, lambda patches, images: images <= limit, args.ingress_max_concurrent_batches
            )

    async def info(self) -> dict:
        """The encoder's `describe()` (model, out_dim, preprocessing, batch limits), fetched once; its
        `preprocess_config` carries this application's decode limits (pixels, formats)."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    info = await self._retrying(lambda: self._watch.call(self._encoder.describe))
                    model_pp = preprocess_config_from_dump(info["preprocess"])
                    info["preprocess_config"] = ingress_preprocess_config(
                        model_pp, self.args.max_image_pixels, self.args.image_formats
                    )
                    video = info.get("video")  # the video processor (Qwen towers), else None
                    info["video_config"] = None if video is None else VideoPreprocessConfig.model_validate(video)
                    self._info = info
        return self._info

    async def _retrying(self, make_call):
        def retried(error: BaseException, attempt: int) -> None:
            self._telemetry.count("encoder_retries")
            self._telemetry.metrics.retries.inc()
            logger.warning("encoder call failed (%s: %s); retry %d", type(error).__name__, error, attempt)

        try:
            return await call_with_retries(
                make_call, self.args.encoder_retries, self.args.encoder_retry_backoff_s, retried
            )
        except BackPressureError:
            self._telemetry.count("encoder_backpressure")
            raise

    async def encode(
        self, arrays: list[np.ndarray], pooling: str, llm: str | None = None, deadline: float | None = None
    ) -> tuple[list, int]:
        """Per image a pooled vector (`llm` None) or a `WireLLM` tuple in the wire dtype `llm`; and the patches.
        `pooling`: resolved (the lifecycle's). `deadline` (`time.time()`): the request's, sent along so the
        encoder drops the work once it passed."""
        info = await self.info()
        p, video = info["preprocess_config"].patch_size, info.get("video_config")
        tps = video.temporal_patch_size if video is not None else 1
        request = EncodeRequest(arrays, [patch_count(x, p, tps) for x in arrays], pooling, llm, deadline)
        return await self._request(request, info), request.patches

    async def encode_texts(self, texts: list[str], pooling: str, deadline: float | None = None) -> list:
        """Per text `(float32 vector, real tokens)`. `pooling`: resolved ("model" or "model-l2"); the model has a
        text side (the lifecycle checked `info()["text"]`)."""
        info = await self.info()
        request = TextRequest(list(texts), [info["text"]["seq_len"]] * len(texts), pooling, deadline)
        return await self._request(request, info)

    async def _request(self, request: EncodeRequest | TextRequest, info: dict) -> list:
        # only what fits one encoder call is merged: a request of several packs would hold a merge slot (and
        # the callers merged with it) for all of them
        small = request.images < self.args.ingress_batch_size and request.patches <= batch_limits(info, request)[0]
        if self._merge is not None and small:
            self._telemetry.count("merged_calls")
            return await self._merge(request)
        return await self._send(request)

    async def _send(self, request: EncodeRequest | TextRequest) -> list:
        info = await self.info()
        ranges = chunk(request.counts, *batch_limits(info, request))
        packs = [request.pack(s, e) for s, e in ranges]

        def call(pack: EncodeRequest | TextRequest):
            if isinstance(pack, TextRequest):
                payload = pack.texts
                big = sum(len(t) for t in pack.texts) > _INLINE_BYTES
            else:
                payload = pack.arrays
                big = (
                    sum(x.nbytes for x in pack.arrays) > _INLINE_BYTES
                    or answer_bytes(info, pack.counts, pack.pooling, pack.llm) > _INLINE_ANSWER_BYTES
                )
            handle = self._encoder_by_ref if big else self._encoder
            # the keyword arguments carry what the router reads (`routing.assignment.request_size`): a bucket
            # caps images as well as patches
            name, kwargs = pack.call()
            method = getattr(handle, name)
            route = "by_reference" if big else "inline"

            async def timed() -> list:
                started = time.perf_counter()
                out = await self._watch.call(method, payload, **kwargs)
                self._telemetry.timings["encoder_call"].add(**{route: time.perf_counter() - started})
                return out

            return timed

        if len(packs) == 1:
            self._telemetry.count("encoder_requests")
            return await self._retrying(call(packs[0]))
        # At most `ingress_packs_in_flight` packs of one request are with the encoder at once, in order: a
        # request queued behind a large one waits for that many packs, not all of them; and when the request
        # is given up (deadline, disconnect, a failed pack) its packs not yet sent are never sent.
        window = asyncio.Semaphore(self.args.ingress_packs_in_flight)

        async def send(pack: EncodeRequest | TextRequest) -> list:
            async with window:
                self._telemetry.count("encoder_requests")
                return await self._retrying(call(pack))

        results = await gather_or_cancel(send(pack) for pack in packs)
        return [v for part in results for v in part]

    async def _run_merged(self, requests: list[EncodeRequest | TextRequest]) -> list[list]:
        """One encoder call per output form of the merged callers (`wire.group`), each caller's outputs back."""
        self._telemetry.count("merged_batches")
        out: list[list | None] = [None] * len(requests)
        groups = group(requests)

        async def run(g) -> None:
            self._telemetry.metrics.merged.observe(g.merged.images)
            g.scatter(await self._send(g.merged), requests, out)

        if len(groups) == 1:  # the usual case: no task for gather to wrap it in
            await run(groups[0])
        else:
            await asyncio.gather(*(run(g) for g in groups))
        return out
