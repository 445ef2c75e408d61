"""The encoder replica deployment: builds the model and captures every bucket graph in its constructor,
then encodes batches of resized uint8 images.

`EncoderReplica` wires the parts of one replica and serves their methods:

* `encode_pixels(pixels, pooling=..., num_patches=n, num_images=k)` and `encode_llm_pixels(pixels, dtype=...,
  num_patches=n, num_images=k)` (the LLM-ready outputs: tokens, DeepStack features, patch grid) validate shapes
  on the event loop and hand the request to the `replica_pipeline.DevicePipeline` (batching, device thread,
  results thread). `num_patches` and `num_images` are keyword arguments on purpose: request routers read them
  from `pending_request.kwargs` without deserialising the pixels (a bucket caps images as well as patches).
* `encode_texts(texts, pooling=..., num_tokens=n, num_texts=k)` (models with a text tower: CLIP, SigLIP2 with
  their tokenizer files): the same pipeline, in text batches of their own; per text `(vector, real tokens)`.
  `num_tokens` (texts x the tower's fixed length) and `num_texts` are what routers read.
* `record_routing_stats()` / `record_replica_metadata()`: `routing_stats.BucketRoutingStats`.
* `check_health()`: `replica_health.HealthProbe`; `inject_fault()` (tests only): `replica_health.FaultInjector`.
* `describe()` (what the ingress needs) and `stats()`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import TYPE_CHECKING

import numpy as np
from ray import serve

from deployments.config import AppArgs, replica_plan, resolve_device, resolve_num_gpus
from deployments.errors import ErrorCode, RequestError, text_off_error
from deployments.llm_outputs import WireLLM, check_dtype
from deployments.metrics import ReplicaMetrics
from deployments.routing.stats import BucketRoutingStats
from deployments.wire import EncodeRequest, TextRequest
from encoder.errors import EncoderError, InvalidArgumentError
from encoder.poolings import POOLINGS, check_pooling
from encoder.tokenization import check_texts

# The torch side (the model, the graphs, the device pipeline) is imported in the constructor and the request
# methods, which run in the replica's own process: a driver that only builds the application (`serve run`,
# the launcher, a test) imports this module for the class and would pay ~3 s of CPU for torch it never uses.
if TYPE_CHECKING:
    from deployments.replica.pipeline import DevicePipeline

logger = logging.getLogger("ray.serve")


def precision(vision) -> str:
    """The tower's number format as the ready line and `describe()` say it: the dtype, and with
    `quantization="fp8"` what runs in FP8 ("bfloat16 with fp8 block linears")."""
    dtype = str(vision.dtype).removeprefix("torch.")
    return f"{dtype} with {vision.quantization} block linears" if vision.quantization else dtype


def startup_summary(
    vision, plan, stats: dict, seconds: float, pipeline: DevicePipeline, text_enabled: bool = True
) -> str:
    """The replica's one start-up line: model and where its weights came from, device, dtype (and FP8 when
    asked for), attention per layer kind, buckets, capture time and memory, batch limits, the text side (or why
    there is none: `text_enabled` False is the application's `text=false`)."""
    info = vision.model_info()
    weights = "RANDOM weights (preset)" if info["random_weights"] else f"weights from {info['kind']} {info.get('path')}"
    attention = ", ".join(f"{kind}={backend}" for kind, backend in stats["attention"].items())
    if stats.get("attention_hint"):  # once per replica start, never per request
        attention += f" ({stats['attention_hint']})"
    buckets = ",".join(str(k.budget) for k in plan.table.keys)
    text = (
        f"text {pipeline.text_seq_len} tokens, up to {pipeline.max_batch_texts} texts a batch"
        if pipeline.text_seq_len
        else "images only (text=false)"
        if not text_enabled
        else "images only (no text tower with its tokenizer)"
    )
    return (
        f"encoder ready: {vision.name}, {weights}, {vision.device} {precision(vision)}, "
        f"attention {attention}; buckets {buckets} ({stats['captures']} graphs captured in "
        f"{stats['capture_seconds']:.1f}s, {stats['capture_bytes'] / 2**20:.0f} MiB); batches up to "
        f"{plan.max_batch_patches} patches / {plan.max_batch_images} images ({pipeline.pipeline_depth} in flight); "
        f"{text}; started in {seconds:.1f}s"
        + (f" after {stats['imports_seconds']:.1f}s of imports" if "imports_seconds" in stats else "")
    )


def text_output_dims(vision) -> dict[str, int]:
    """{text pooling: its vector size} of a model that takes text, else {}."""
    if not vision.supports_text:
        return {}
    from encoder.text_encoder import TEXT_POOLINGS

    return dict.fromkeys(TEXT_POOLINGS, vision.text.config.out_dim)


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.5}, health_check_period_s=10)
class EncoderReplica:
    """Serve deployment of one encoder: `encode_pixels` for the ingress, stats for routers and tests."""

    def __init__(self, args: dict):
        entered = time.perf_counter()
        import encoder
        from deployments.replica.health import FaultInjector, HealthProbe, probe_pixels
        from deployments.replica.pipeline import DevicePipeline
        from encoder.api import vector_pooling
        from encoder.patchify import stack_patchify
        from workspace import GraphEncoder

        self.args = a = AppArgs.model_validate(args)
        if a.gil_switch_interval_s is not None:  # this process is the replica's own
            sys.setswitchinterval(a.gil_switch_interval_s)
        self.device_name = resolve_device(a, resolve_num_gpus(a))
        start = time.perf_counter()
        # build_app warned once, in one line, that a preset's weights are random, and the ready line below marks
        # them; the warning again from every replica, in warnings' file:line form, is noise. This process is
        # the replica's own, so the filter stays (no catch_warnings: it is not thread-safe)
        warnings.filterwarnings("ignore", category=encoder.RandomWeightsWarning)
        vision = encoder.load(
            a.model, device=self.device_name, dtype=a.dtype, attention=a.attention, seed=a.seed,
            quantization=a.quantization,
            text=a.text,  # the text tower, where the model has one with its tokenizer, unless text is off
        )  # fmt: skip
        self.pp = vision.preprocess_config
        self.video_cfg = vision.video_config  # None: the model takes no video (not a Qwen tower)
        plan = replica_plan(a, vision, self.device_name)
        self.engine = GraphEncoder(vision, plan.table)
        self.device = vision.device
        self.metrics = ReplicaMetrics()
        self.faults = FaultInjector(a.enable_fault_injection)
        cuda = self.device.type == "cuda"
        self.pipeline = DevicePipeline(
            self.engine,
            plan,
            batcher=a.batcher,
            pipeline_depth=a.pipeline_depth or (2 if cuda else 1),
            fixed_cost=a.batch_fixed_cost_patches if cuda else None,
            batch_wait_timeout_s=a.batch_wait_timeout_s,
            metrics=self.metrics,
            before_launch=self.faults.wait_if_held if a.enable_fault_injection else None,
        )
        self.health = HealthProbe(self.pipeline, self.metrics, self.faults)
        # DeepStack layers of the LLM-ready outputs (0 for towers without), from one tiny encode
        probe = stack_patchify(probe_pixels(self.pp), self.pp, self.device)
        self.deepstack_layers = len(self.engine.encode_llm(probe)[0].deepstack)
        # the service's one-vector default (`encoder.api.vector_pooling`; not `VisionEncoder.default_pooling`,
        # which is the library's "none" for the Qwen towers) and the poolings this model supports, with their sizes
        self.vector_pooling = vector_pooling(vision.config)
        self.output_dims = {p: vision.output_dim(p) for p in POOLINGS if self._supports(p)}
        self.text_output_dims = text_output_dims(vision)
        stats = self.engine.stats()
        self.metrics.captured.set(stats["captures"])
        self.ready = True
        stats["attention_hint"] = self.engine.attention_hint()
        stats["imports_seconds"] = start - entered  # torch and ours: a phase of the cold start
        logger.info("%s", startup_summary(vision, plan, stats, time.perf_counter() - start, self.pipeline, a.text))

    # -- the request methods -----------------------------------------------------------------------------
    async def encode_pixels(
        self,
        pixels,
        *,
        pooling: str | None = None,
        num_patches: int | None = None,
        num_images: int | None = None,
        deadline: float | None = None,
    ) -> list[np.ndarray]:
        """Encode resized uint8 images ([H, W, 3], sides multiples of patch*merge: `resize_image` output).

        Returns one float32 array per image: [out_dim] for `pooling="mean"`, [tokens, out_dim] for
        `"none"`; `pooling=None` is the service's vector pooling (`describe()["vector_pooling"]`). The ingress
        sends a resolved pooling; the replica only checks that this model supports it (an unsupported one
        would fail the whole batch it joined). `num_patches` (total patches of the request) and `num_images`
        are what routers read; when given they must match the pixels. `deadline` (`time.time()`, the caller's
        request deadline): the work is dropped, with `TimeoutError`, if it has not started by then
        (`replica.pipeline.DevicePipeline`).
        """
        from deployments.replica.pipeline import check_pixels

        entered = time.perf_counter()
        pooling = self._pooling(pooling)
        work = EncodeRequest(*check_pixels(pixels, self.pp, self.video_cfg), pooling, deadline=deadline)
        return await self._encode(work, num_patches, num_images, entered)

    async def encode_llm_pixels(
        self,
        pixels,
        *,
        dtype: str = "float32",
        num_patches: int | None = None,
        num_images: int | None = None,
        deadline: float | None = None,
    ) -> list[WireLLM]:
        """The LLM-ready outputs of resized uint8 images (as `encode_pixels`, same batches and device thread):
        per image `(tokens [n, out_dim], [DeepStack layer [n, out_dim], ...], (t, h, w))`, the arrays in the
        wire `dtype` (`deployments.llm_outputs`: float32, float16, or bfloat16 bit patterns as uint16),
        converted in the results thread. `[]` DeepStack layers for towers without them."""
        from deployments.replica.pipeline import check_pixels

        entered = time.perf_counter()
        check_dtype(dtype)
        work = EncodeRequest(*check_pixels(pixels, self.pp, self.video_cfg), "none", dtype, deadline=deadline)
        return await self._encode(work, num_patches, num_images, entered)

    async def encode_texts(
        self,
        texts,
        *,
        pooling: str | None = None,
        num_tokens: int | None = None,
        num_texts: int | None = None,
        deadline: float | None = None,
    ) -> list[tuple[np.ndarray, int]]:
        """Embed texts (a list of non-empty strings): per text `(float32 vector [out_dim], real tokens)`, the
        tokens being the text's own (its attention mask: special tokens counted, pads not). `pooling`: "model"
        (None) or "model-l2". Texts are tokenized here, in the device thread, as the model's tokenizer does
        (`replica.pipeline`): an over-long text is cut to the tower's length. `num_tokens` (texts x that
        length) and `num_texts` are what routers read; when given they must match. `deadline` as
        `encode_pixels`. 400 `text_not_supported` (a `RequestError`) when the model has no text tower or the
        application serves images only (`text=false`)."""
        from encoder.text_encoder import check_text_pooling

        entered = time.perf_counter()
        seq_len = self.pipeline.text_seq_len
        if not seq_len and not self.args.text:
            raise text_off_error(self.args.model_name)
        if not seq_len:
            raise RequestError(
                f"model {self.engine.encoder.name!r} takes no text: text needs an image-text checkpoint (CLIP, "
                "SigLIP2) with its tokenizer files",
                ErrorCode.TEXT_NOT_SUPPORTED, "input",
            )  # fmt: skip
        texts = check_texts(texts)
        work = TextRequest(texts, [seq_len] * len(texts), check_text_pooling(pooling), deadline)
        if num_texts is not None and int(num_texts) != len(texts):
            raise InvalidArgumentError(f"num_texts={num_texts} but {len(texts)} texts were sent")
        if num_tokens is not None and int(num_tokens) != work.patches:
            raise InvalidArgumentError(f"num_tokens={num_tokens} but the texts take {work.patches} ({seq_len} each)")
        if not texts:
            return []
        return await self.pipeline.submit(work, entered)

    async def _encode(
        self, work: EncodeRequest, num_patches: int | None, num_images: int | None, entered: float
    ) -> list:
        if num_patches is not None and int(num_patches) != work.patches:
            raise InvalidArgumentError(f"num_patches={num_patches} but the pixels have {work.patches} patches")
        if num_images is not None and int(num_images) != len(work.arrays):
            raise InvalidArgumentError(f"num_images={num_images} but {len(work.arrays)} images were sent")
        if not work.arrays:
            return []
        return await self.pipeline.submit(work, entered)

    # -- control plane ---------------------------------------------------------------------------------------
    def record_routing_stats(self) -> dict:
        """Published to request routers (`RunningReplica.routing_stats`) every `routing_stats_period_s`
        (`deployments.routing.stats`), plus queued_requests / queued_patches (totals) for dashboards and tests."""
        stats = BucketRoutingStats.from_table(
            self.engine.table, self.pipeline.queued_by_bucket(), self.ready, self.pipeline.max_batch_patches
        )
        return stats.to_dict() | self.pipeline.queue_totals()

    def record_replica_metadata(self) -> dict:
        """Published once when the replica starts, so routers know its table before the first stats poll."""
        return self.record_routing_stats()

    async def check_health(self) -> None:
        """Serve's health check (`replica_health.HealthProbe`)."""
        await self.health.check()

    async def inject_fault(self, kind: str | None, switch=None, timeout_s: float = 60.0) -> str:
        """Tests only (`AppArgs.enable_fault_injection`): "hold", "unhealthy", "corrupt" or None
        (`replica_health.FaultInjector.inject`). Returns this replica's actor name
        (`ray.get_actor(name, namespace="serve")`), so a test knows which replica it hit."""
        if kind == "corrupt":
            await self.health.corrupt()
        else:
            self.faults.inject(kind, switch, timeout_s)
        return serve.get_replica_context().replica_id.to_full_id_str()

    def __del__(self):
        # Serve calls this once the replica drained its requests (graceful shutdown).
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            pipeline.shutdown()

    def _pooling(self, pooling: str | None) -> str:
        """`pooling`, or the vector pooling when None; refused unless this model supports it."""
        if pooling is None:
            return self.vector_pooling
        if pooling not in self.output_dims:
            check_pooling(pooling)  # an unknown name: that message
            raise InvalidArgumentError(
                f"pooling {pooling!r} is not supported by this model; supported: {', '.join(self.output_dims)}"
            )
        return pooling

    def _supports(self, pooling: str) -> bool:
        try:
            self.engine.encoder.resolve_pooling(pooling)
        except EncoderError:
            return False
        return True

    def describe(self) -> dict:
        """Model and batching facts the ingress needs (preprocessing, limits) and tests inspect."""
        vision = self.engine.encoder
        return {
            "model": vision.name,
            "model_info": vision.model_info(),  # its source: kind, path, Hub revision and commit (the cache's key)
            "family": vision.config.family,  # the tower family (e.g. qwen3_vl): which LLM hand-offs apply
            "out_dim": vision.out_dim,
            "vector_pooling": self.vector_pooling,
            "output_dims": dict(self.output_dims),
            "deepstack_layers": self.deepstack_layers,
            "device": str(self.device),
            "dtype": str(vision.dtype).removeprefix("torch."),
            "quantization": vision.quantization,  # None or "fp8" (the blocks' linear layers)
            "preprocess": self.pp.model_dump(mode="json"),
            # the video processor's settings and limits (Qwen towers), None: the model takes no video
            "video": None if self.video_cfg is None else self.video_cfg.model_dump(mode="json"),
            "buckets": [[k.budget, k.max_images] for k in self.engine.table.keys],
            "max_batch_patches": self.pipeline.max_batch_patches,
            "max_batch_images": self.pipeline.max_batch_images,
            "graphs_captured": self.ready,
            "attention": self.engine.stats()["attention"],  # per layer kind: what `auto` picked per graph shape
            "random_weights": vision.random_weights,
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            # the text side (None: images only): its fixed length, batch limit and poolings with their sizes
            "text": None
            if not self.pipeline.text_seq_len
            else {
                "seq_len": self.pipeline.text_seq_len,
                "max_batch_texts": self.pipeline.max_batch_texts,
                "output_dims": dict(self.text_output_dims),
            },
        }

    def stats(self) -> dict:
        """The engine's counters (captures, replays per budget, eager runs, patches), this replica's batches
        (count, requests and images in them, busy seconds), queue state, the process's id and GIL switch interval."""
        return (
            self.engine.stats()
            | dict(self.pipeline.batches)
            | self.record_routing_stats()
            | {
                "replica_id": serve.get_replica_context().replica_id.unique_id,
                "pid": os.getpid(),
                "gil_switch_interval_s": sys.getswitchinterval(),
                "pipeline_depth": self.pipeline.pipeline_depth,
                "timings_ms": self.pipeline.timings.p50_ms(),
            }
        )
