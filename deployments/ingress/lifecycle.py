"""One request's life in the ingress, written once for both ways in (HTTP routes and handle calls).

`Lifecycle.run(route, n_images, body, on_error)` holds the request: its admission ticket (`limits.Admission`:
bytes, the request slot, patches), its time limit (`request_timeout_s`), and its accounting
(`metrics.IngressTelemetry`: the request's outcome, images, patches and latency; the phases of the last
requests), released and recorded on every path (an answer, an error, a cancelled call or a client gone).
`body(flight)` is the adapter's part under the time limit: it reserves what its input holds
(`Flight.reserve_bytes`), takes the slot (`Flight.enter`), parses its input into an `EmbedOrder` and calls
`Lifecycle.encode(flight, order)`: pooling resolved once (None: the service's vector pooling for this model,
`describe()["vector_pooling"]`; else one this model supports, 400 `invalid_pooling`) and the output size
checked, the images opened, admitted by patches and decoded (`decoding.IngressDecoder`), then the encoder call
(`encoder_calls.EncoderClient`) with the request's deadline. An order's texts go the same way beside its
images: text support checked (400 `text_not_supported`), their pooling resolved (`resolve_text_pooling`),
admitted by tokens (each text holds the text tower's fixed length, as it does on the device), then their own
encoder call (`EncoderClient.encode_texts`; tokenized on the replica), concurrently with the images'; the
outputs come back in the order's item order. `on_error(exc, flight, expired)` shapes a failure
as its way in answers one (an HTTP error answer, or the exception a handle caller gets) with its outcome.
`refused_draining` answers for both while the service shuts down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from deployments.aio import gather_or_cancel
from deployments.config import AppArgs
from deployments.errors import DISCONNECTED, OK, OVERLOADED, ErrorCode, RequestError, text_off_error
from deployments.ingress.cache import CacheKey, EncoderCache, Form, Lookup, image_keys, model_fingerprint, text_digest
from deployments.ingress.decoding import IngressDecoder
from deployments.ingress.encoder_calls import EncoderClient
from deployments.ingress.limits import Admission, Ticket, check_request_patches
from deployments.metrics import IngressTelemetry
from deployments.shutdown import DrainWatch
from deployments.vllm_handoff import check_uuids, check_vllm_model, ec_cache_item, vllm_wire, write_ec_cache
from deployments.wire import patch_count

T = TypeVar("T")


@dataclass
class EmbedOrder:
    """A parsed request, as either way in hands it to the lifecycle."""

    images: list
    pooling: str | None = None  # as asked (a known name); None: the service's vector pooling for this model
    llm: str | None = None  # the LLM-ready outputs in this wire dtype instead of pooled vectors (pooling "none")
    dimensions: int | None = None  # the output size the caller expects (HTTP's `dimensions`), checked
    label: str = "images"  # how errors name an input: "input" (HTTP), "images" (handle)
    max_patches: int | None = None  # the request's patch limit (HTTP's; none for handle calls)
    texts: list[str] = field(default_factory=list)  # checked: non-empty strings
    kinds: list[str] | None = None  # per item "image" or "text", the answer's order; None: the images, then texts
    layout: str = "parts"  # LLM outputs: "parts" (tokens, DeepStack apart) or "vllm" (one tensor, `vllm_handoff`)
    videos: list = field(default_factory=list)  # encoded videos or uint8 [frames, H, W, 3] arrays (Qwen towers)
    video_label: str = "videos"  # how errors name a video without kinds (handle calls)
    cache: bool = True  # look images and texts up in the service's encoder cache and store them (when it has one)
    uuids: list | None = None  # per image the client's own cache key or None (`cache.check_cache_uuids`)
    scope: str = "handle"  # whose client keys they are: an HTTP request's API key identity, or "handle"

    def ordered(self, images: list, texts: list, videos: list | None = None) -> list:
        """The outputs of the images, videos and texts, in the order's item order."""
        if self.kinds is None:
            return images + (videos or []) + texts
        by_kind = {"image": iter(images), "text": iter(texts), "video": iter(videos or [])}
        return [next(by_kind[k]) for k in self.kinds]

    def image_label(self, kind: str = "image"):
        """How errors name image (or video) i: `label[i]`, or with kinds its position among all the items."""
        if self.kinds is None or set(self.kinds) <= {kind}:
            return self.label if kind == "image" or self.kinds is not None else self.video_label
        positions = [i for i, k in enumerate(self.kinds) if k == kind]
        return lambda i: f"{self.label}[{positions[i]}]"


def patch_counts(images: list, info: dict) -> list[int]:
    """Each resized image's patches (as `EncoderClient.encode` counts them)."""
    p = info["preprocess_config"].patch_size
    return [(x.shape[0] // p) * (x.shape[1] // p) for x in images]


def _admit_with(extra: int, max_patches: int | None, reserve: Callable[[int], None]) -> Callable[[int], None]:
    """The decoder's patch admission of a request's images to decode, with the request's limit held against
    them and `extra` patches it has apart from them (cache hits, videos); only the decoded images are reserved."""

    def admit(total: int) -> None:
        if max_patches is not None:
            check_request_patches(total + extra, max_patches)
        reserve(total)

    return admit


def text_info(info: dict, model_name: str, what: str = "text", enabled: bool = True) -> dict:
    """The encoder's text facts (`describe()["text"]`), or 400 `text_not_supported` when the model has none or
    the application serves images only (`enabled` False: `AppArgs.text`)."""
    if not enabled:
        raise text_off_error(model_name)
    text = info.get("text")
    if text is None:
        raise RequestError(
            f"the served model {model_name!r} takes no text ({what}): text needs an image-text checkpoint (CLIP, "
            "SigLIP2) with its tokenizer files",
            ErrorCode.TEXT_NOT_SUPPORTED, "input",
        )  # fmt: skip
    return text


def resolve_text_pooling(pooling: str | None, text: dict) -> str:
    """A text's pooling: None is "model" (the model's text embedding); else one of the text side's."""
    pooling = pooling or "model"
    if pooling not in text["output_dims"]:
        raise RequestError(
            f"pooling {pooling!r} applies to images only; text items take {' or '.join(text['output_dims'])}",
            ErrorCode.INVALID_POOLING, "pooling",
        )  # fmt: skip
    return pooling


def check_vllm_order(order: EmbedOrder, info: dict, model_name: str) -> None:
    """400 `invalid_layout` for the vLLM layout where it makes no sense: a non-Qwen tower, texts, a pooling other
    than "none" (the layout is of the LLM outputs; `llm` is their wire dtype)."""
    check_vllm_model(info.get("family"), model_name)
    if order.texts:
        raise RequestError("the vLLM layout is of image outputs; this request has text items",
                           ErrorCode.INVALID_LAYOUT, "embedding_layout")  # fmt: skip
    if order.pooling not in (None, "none") or order.llm is None:
        raise RequestError(
            f"the vLLM layout is of the per-token LLM outputs (pooling 'none'), not pooling {order.pooling!r}",
            ErrorCode.INVALID_LAYOUT, "embedding_layout",
        )  # fmt: skip


def resolve_pooling(pooling: str | None, info: dict, model_name: str) -> str:
    """The request's pooling: None is the service's vector pooling for this model; else one it supports."""
    pooling = pooling or info["vector_pooling"]
    if pooling not in info["output_dims"]:
        raise RequestError(
            f"pooling {pooling!r} is not offered by the served model {model_name!r}; its poolings: "
            f"{', '.join(info['output_dims'])}",
            ErrorCode.INVALID_POOLING, "pooling",
        )  # fmt: skip
    return pooling


class Flight:
    """What one request holds and has done: its admission ticket, images, patches and phase timings."""

    def __init__(self, admission: Admission, n_images: int) -> None:
        self.started = time.perf_counter()
        self.ticket = Ticket()
        self.n_images, self.patches = n_images, 0
        self.text_tokens = 0  # real tokens of the request's texts (pads not counted), as the replica counted them
        self.phases: dict[str, float] = {}  # seconds per phase, recorded when the request succeeds
        self.decode_at = self.started  # when the images started to open
        self._admission = admission

    def reserve_bytes(self, n: int) -> None:
        self._admission.reserve_bytes(self.ticket, n)

    def enter(self) -> None:
        """Take a request slot (429 when this replica is full)."""
        self._admission.enter(self.ticket)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class Lifecycle:
    """Admission, decode, deadline, encoder call and accounting of this ingress replica's requests."""

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
        self.args, self._client, self._decoder = args, client, decoder
        self._admission, self._telemetry, self._drain = admission, telemetry, drain
        self._cache, self._model_key = cache, None

    def refused_draining(self, route: str, n_images: int, started: float) -> bool:
        """True (and counted, outcome overloaded) while the service shuts down: the caller gets a 503."""
        if self._drain is None or self._drain.admitting():
            return False
        self._telemetry.request(route, OVERLOADED, n_images, 0, time.perf_counter() - started)
        return True

    async def run(
        self,
        route: str,
        n_images: int,
        body: Callable[[Flight], Awaitable[T]],
        on_error: Callable[[Exception, Flight, bool], tuple[T | BaseException, str]],
        released: Callable[[int], None] | None = None,
        started: float | None = None,
    ) -> T:
        """`body(flight)` under the request's time limit, with everything it holds released and its outcome
        recorded whatever happens. A failure goes to `on_error(exc, flight, expired)` (`expired`: the time limit
        passed), which returns the answer (or the exception to raise) and the outcome. `released(bytes)`: called
        last with the bytes the request held."""
        flight = Flight(self._admission, n_images)
        if started is not None:
            flight.started = flight.decode_at = started
        outcome = OK
        timer = asyncio.timeout(self.args.request_timeout_s)
        try:
            async with timer:
                result = await body(flight)
            if flight.phases:  # it reached the encoder (not an empty handle call)
                self._telemetry.timings[route].add(total=flight.elapsed(), **flight.phases)
            return result
        except asyncio.CancelledError:  # the caller went away (HTTP client, handle call cancelled)
            outcome = DISCONNECTED
            raise
        except Exception as e:
            answer, outcome = on_error(e, flight, timer.expired())
            if isinstance(answer, BaseException):
                if answer is e:
                    raise
                raise answer from None
            return answer
        finally:
            held = flight.ticket.bytes
            self._admission.leave(flight.ticket)
            self._telemetry.request(route, outcome, flight.n_images, flight.patches, flight.elapsed())
            if released is not None:
                released(held)

    async def encode(self, flight: Flight, order: EmbedOrder) -> list:
        """Per item of `order` its output: pooling resolved, images decoded (patches admitted), texts admitted by
        tokens, the encoder calls with the request's deadline. Records the decode and encode phases, the
        request's patches and its texts' tokens."""
        if not order.images and not order.texts and not order.videos:
            return []
        info = await self._client.info()
        if order.layout == "vllm":
            check_vllm_order(order, info, self.args.model_name)
        text = text_info(info, self.args.model_name, enabled=self.args.text) if order.texts else None
        flight.decode_at = decode_at = time.perf_counter()
        reserve = partial(self._admission.reserve_patches, flight.ticket)
        images = None
        if text is not None:
            text_pooling = resolve_text_pooling(order.pooling, text)
            self._check_dimensions(order.dimensions, text["output_dims"][text_pooling], text_pooling)
        if order.images or order.videos:
            pooling = resolve_pooling(order.pooling, info, self.args.model_name)
            self._check_dimensions(order.dimensions, info["output_dims"][pooling], pooling)
        # Images and texts are looked up in the encoder cache (when it is on and not bypassed); videos never are:
        # they are always decoded and encoded (their outputs are not stored), so their results, timestamps,
        # second_per_grid_ts and errors are video-serve's whatever the cache holds.
        lookup = await self._lookup(order, info, pooling if order.images else None,
                                    text_pooling if text is not None else None)  # fmt: skip
        image_items, texts = order.images, order.texts
        if lookup is not None:
            image_items, texts = lookup.misses("image", image_items), lookup.misses("text", texts)
        if text is not None and texts:
            reserve(len(texts) * text["seq_len"])  # what they hold on the device: the tower's fixed length
        videos, video_patches = await self._videos(order, info, reserve)
        hit_patches = lookup.hit_patches if lookup is not None else 0
        if image_items:
            pp = info["preprocess_config"]
            label, max_patches, admit = order.image_label(), order.max_patches, reserve
            if hit_patches:
                label = lookup.miss_label(label)
            if hit_patches or video_patches:  # the request's patch limit counts its hits' and videos' too
                max_patches, admit = None, _admit_with(hit_patches + video_patches, order.max_patches, reserve)
            images = await self._decoder.prepare(image_items, pp, label, max_patches, admit)
        elif hit_patches and order.max_patches is not None:  # every image a hit: the request's limit
            check_request_patches(hit_patches + video_patches, order.max_patches)
        n_images = len(images) if images is not None else 0
        arrays = (images or []) + [frames for frames, *_ in videos]
        encode_at = time.perf_counter()
        deadline = time.time() + self.args.request_timeout_s - flight.elapsed()
        calls = []
        if arrays:
            calls.append(self._client.encode(arrays, pooling, order.llm, deadline))
        if text is not None and texts:
            calls.append(self._client.encode_texts(texts, text_pooling, deadline))
        results = [] if not calls else await (calls[0] if len(calls) == 1 else gather_or_cancel(calls))
        if len(calls) == 1:
            results = [results]
        counts = [] if images is None or lookup is None else patch_counts(images, info)
        del images, arrays
        image_out, video_out, text_out, tokens = [], [], [], []
        if image_items or videos:
            image_out, flight.patches = results[0]
            if order.llm is not None and videos:  # a video's LLM outputs carry its facts after the grid
                # (`llm_outputs.VIDEO_FACTS`: timestamps, second_per_grid_ts)
                stamped = [(*w, *facts) for w, (_, *facts) in zip(image_out[n_images:], videos, strict=True)]
                image_out = image_out[:n_images] + stamped
            if order.layout == "vllm":
                image_out = [vllm_wire(w) for w in image_out]
            image_out, video_out = image_out[:n_images], image_out[n_images:]
        if text is not None and texts:
            answered = results[-1]
            text_out, tokens = [vec for vec, _ in answered], [n for _, n in answered]
            flight.text_tokens = sum(tokens)
        if lookup is not None:  # the hits' stored outputs in their places, the misses stored
            if order.images:
                image_out, image_patches = lookup.finish("image", image_out, counts)
                flight.patches = image_patches + video_patches
            if text is not None:
                text_out, flight.text_tokens = lookup.finish("text", text_out, tokens)
        flight.phases.update(decode=encode_at - decode_at, encode=time.perf_counter() - encode_at)
        return order.ordered(image_out, text_out, video_out)

    async def _videos(self, order: EmbedOrder, info: dict, reserve: Callable[[int], None]) -> tuple[list, int]:
        """The order's videos decoded (`IngressDecoder.prepare_videos`: per video its frames, timestamps and
        second_per_grid_ts) and their patches (`cfg.grid` of the sampled frames) checked against the request's
        limit and reserved; 400 `video_not_supported` for a tower without a video processor."""
        if not order.videos:
            return [], 0
        vcfg = info.get("video_config")
        if vcfg is None:
            raise RequestError(
                f"the served model {self.args.model_name!r} takes no video: video needs a Qwen2-VL, Qwen2.5-VL, "
                "Qwen3-VL or Qwen3.5 tower",
                ErrorCode.VIDEO_NOT_SUPPORTED, "input",
            )  # fmt: skip
        videos = await self._decoder.prepare_videos(order.videos, vcfg, order.image_label("video"))
        patches = sum(patch_count(f, vcfg.patch_size, vcfg.temporal_patch_size) for f, *_ in videos)
        if order.max_patches is not None:
            check_request_patches(patches, order.max_patches)
        reserve(patches)
        return videos, patches

    async def _lookup(self, order: EmbedOrder, info: dict, pooling: str | None, text_pooling: str | None):
        """The order's items against the encoder cache (`cache.Lookup`); None when it is off or bypassed."""
        if self._cache is None or not order.cache:
            return None
        if self._model_key is None:
            self._model_key = model_fingerprint(info, self.args)
        model = self._model_key
        keys = []
        if order.images:
            form = Form("image", pooling, order.llm, order.layout)
            keys = await image_keys(model, form, order.images, order.uuids, order.scope, self.args.max_image_bytes)
        text_keys = []
        if text_pooling is not None:
            form = Form("text", text_pooling)
            text_keys = [CacheKey(model, form, ("sha256", text_digest(t))) for t in order.texts]
        return Lookup(self._cache, keys, text_keys)

    async def info(self) -> dict:
        """The encoder's facts (`EncoderClient.info`: fetched once)."""
        return await self._client.info()

    def ec_cache_dtype(self, asked: str | None, info: dict) -> str:
        """The dtype of the files written for vLLM's disk connector: `asked`, else the served tower's own
        (bfloat16 on a GPU, as vLLM's encoder would store it; float32 on a CPU)."""
        if asked is not None:
            return asked
        dtype = info.get("dtype", "float32")
        return dtype if dtype in ("float32", "float16", "bfloat16") else "float32"

    def check_ec_cache(self, uuids, n_images: int, has_texts: bool, where: str) -> list[str]:
        """The request's uuids, checked (one safe, distinct name per image), where the service has a cache
        directory; 400 otherwise."""
        if self.args.ec_cache_dir is None:
            raise RequestError(
                "this service writes no encoder-cache files: it was started without ec_cache_dir",
                ErrorCode.EC_CACHE_NOT_CONFIGURED, "ec_cache_uuids",
            )  # fmt: skip
        if has_texts:
            raise RequestError("encoder-cache files are of images; this request has text items",
                               ErrorCode.INVALID_REQUEST, "ec_cache_uuids")  # fmt: skip
        return check_uuids(uuids, n_images, where)

    async def write_ec_cache(self, flight: Flight, order: EmbedOrder, uuids: list[str]) -> list[dict]:
        """Encode `order` (vLLM layout, wire dtype `order.llm`) and write each image's tensor for vLLM's disk
        connector under `ec_cache_dir` (`vllm_handoff.write_ec_cache`, off the event loop); per image
        `vllm_handoff.ec_cache_item` with its `path`."""
        outputs = await self.encode(flight, order)
        root = self.args.ec_cache_dir
        written_at = time.perf_counter()
        paths = await asyncio.to_thread(
            lambda: [write_ec_cache(root, u, w[0], order.llm) for u, w in zip(uuids, outputs, strict=True)]
        )
        flight.phases["write"] = time.perf_counter() - written_at
        return [
            ec_cache_item(i, u, w, order.llm) | {"path": p}
            for i, (u, w, p) in enumerate(zip(uuids, outputs, paths, strict=True))
        ]

    @staticmethod
    def _check_dimensions(asked: int | None, dim: int, pooling: str) -> None:
        if asked is not None and asked != dim:
            raise RequestError(
                f"dimensions={asked} is not supported; this model outputs {dim} with pooling={pooling}",
                ErrorCode.INVALID_DIMENSIONS, "dimensions",
            )  # fmt: skip
