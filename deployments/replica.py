"""The encoder replica: builds the model and captures every bucket graph in its constructor, then
encodes batches of resized uint8 images.

Request path inside a replica (DESIGN.md, "The request path"):
  `encode_pixels(pixels, pooling=..., num_patches=n)` (or `encode_llm_pixels(pixels, dtype=..., num_patches=n)`
  for the LLM-ready outputs: tokens, DeepStack features, patch grid) validates shapes on the event loop, queues the
  request, and a batcher merges queued requests (from any number of callers) into one batch of at
  most `max_batch_patches` patches / `max_batch_size` images. The batch runs in ONE worker thread:
  upload the uint8 pixels, normalise and patchify on the device, one `GraphEncoder.encode` (which packs
  the batch into bucket replays), download, split per request. The event loop never runs device work,
  so it keeps answering the router's queue-length probes and `record_routing_stats`.

`num_patches` is a keyword argument on purpose: request routers read it from
`pending_request.kwargs["num_patches"]` without deserialising the pixels.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from ray import serve

import encoder
from encoder.api import POOLINGS, check_pooling, vector_pooling
from encoder.errors import EncoderError, InvalidArgumentError, InvalidImageError
from encoder.preprocess import PreprocessConfig, stack_patchify
from workspace import GraphEncoder

from .batching import ContinuousBatcher
from .config import AppArgs, replica_plan, resolve_device, resolve_num_gpus
from .llm_outputs import WIRE_TORCH_DTYPES, WireLLM, check_dtype, wire_outputs
from .metrics import RecentTimings, ReplicaMetrics

logger = logging.getLogger("ray.serve")


def _sticky_device_error(e: BaseException) -> bool:
    """An error after which the device (CUDA context) cannot be trusted: the replica must be replaced."""
    text = str(e)
    return "CUDA error" in text or "CUBLAS" in text or "illegal memory access" in text


@dataclass
class Work:
    """One request inside the replica."""

    arrays: list[np.ndarray]  # uint8 [H, W, 3], sides multiples of patch_size * merge_size
    counts: list[int]  # patches per image
    pooling: str
    llm: str | None = None  # LLM-ready outputs in this wire dtype (`deployments.llm_outputs`) instead of pooling
    queued_at: float = field(default_factory=time.perf_counter)

    @property
    def patches(self) -> int:
        return sum(self.counts)


def check_pixels(pixels, pp: PreprocessConfig) -> tuple[list[np.ndarray], list[int]]:
    """Validate resized uint8 images and count their patches (cheap: shapes only)."""
    if isinstance(pixels, np.ndarray | torch.Tensor):
        raise InvalidArgumentError("pixels must be a list of uint8 [H, W, 3] arrays, not one array")
    arrays, counts = [], []
    for i, x in enumerate(pixels):
        if isinstance(x, torch.Tensor):
            x = x.cpu().numpy()
        if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 3 or x.shape[2] != 3:
            what = f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}".strip()
            raise InvalidImageError(f"pixels[{i}]: expected a uint8 [H, W, 3] array, got {what}")
        h, w, _ = x.shape
        if h == 0 or w == 0 or h % pp.factor or w % pp.factor:
            raise InvalidImageError(
                f"pixels[{i}]: sides must be non-zero multiples of {pp.factor} (resize_image output); got {h}x{w}"
            )
        arrays.append(x)
        counts.append((h // pp.patch_size) * (w // pp.patch_size))
    return arrays, counts


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.5}, health_check_period_s=10)
class EncoderReplica:
    """Serve deployment of one encoder: `encode_pixels` for the ingress, stats for routers and tests."""

    def __init__(self, args: dict):
        self.args = a = AppArgs.model_validate(args)
        if a.gil_switch_interval_s is not None:  # this process is the replica's own
            sys.setswitchinterval(a.gil_switch_interval_s)
        self.device_name = resolve_device(a, resolve_num_gpus(a))
        start = time.perf_counter()
        vision = encoder.load(a.model, device=self.device_name, dtype=a.dtype, attention=a.attention, seed=a.seed)
        self.pp = vision.preprocess_config
        plan = replica_plan(a, vision, self.device_name)
        self.engine = GraphEncoder(vision, plan.table)
        self.device = vision.device
        table = self.engine.table
        self.max_batch_patches, self.max_batch_images = plan.max_batch_patches, plan.max_batch_images
        # The device thread uploads, patchifies and queues replays; the results thread waits for a batch's
        # device work and splits its outputs. With pipeline_depth 2 the device thread prepares batch N+1
        # while batch N replays, so the GPU does not idle through the host's part of every batch.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="encoder-device")
        self._results = ThreadPoolExecutor(1, thread_name_prefix="encoder-results")
        self.pipeline_depth = a.pipeline_depth or (2 if self.device.type == "cuda" else 1)
        self._fatal: BaseException | None = None
        self._queued: Counter[str] = Counter()
        self._queued_patches = 0
        # batches run, requests and images in them, seconds the device thread spent on them
        # batches run, requests and images in them; seconds from launch to results (overlapping batches both
        # count) and seconds the device thread spent preparing and queueing them
        self._batches = {
            "batches": 0, "batched_requests": 0, "batched_images": 0, "busy_seconds": 0.0, "launch_seconds": 0.0,
        }  # fmt: skip
        self.metrics = ReplicaMetrics()
        # the last requests (time inside this replica) and batches (queue wait, device thread, results)
        self._timings = RecentTimings()
        # Trim batches to the prefix with the most patches per unit of replay cost (graphs only: on the CPU
        # the engine runs images one by one, so a longer batch costs nothing extra).
        self._fixed_cost = a.batch_fixed_cost_patches if self.device.type == "cuda" else None
        if a.batcher == "continuous":
            keep = self._keep if self._fixed_cost else None
            self._submit = ContinuousBatcher(self._run_batch, self._fits, self.pipeline_depth, keep=keep)
        else:
            # Batch "size" in image slots: max(patches scaled so the patch limit equals the image limit,
            # images). One number enforces both limits and stays <= max_ongoing_requests.
            self._submit = serve.batch(
                max_batch_size=self.max_batch_images,
                batch_wait_timeout_s=a.batch_wait_timeout_s,
                max_concurrent_batches=self.pipeline_depth,
                batch_size_fn=self._batch_units,
            )(self._run_batch)
        # Health: a tiny real encode through the graph path, compared with its output at start-up.
        side = self.pp.factor * max(1, -(-int(self.pp.min_pixels**0.5) // self.pp.factor))
        ramp = (np.arange(side * side * 3, dtype=np.int64) * 37 % 251).astype(np.uint8)
        self._probe_pixels = [ramp.reshape(side, side, 3)]
        self._probe_ref = self._probe()
        # DeepStack layers of the LLM-ready outputs (0 for towers without), from one tiny encode
        self.deepstack_layers = len(
            self.engine.encode_llm(stack_patchify(self._probe_pixels, self.pp, self.device))[0].deepstack
        )
        self._fault: str | None = None  # inject_fault("unhealthy")
        self._hold = None  # inject_fault("hold"): (switch actor, timeout)
        stats = self.engine.stats()
        self.metrics.captured.set(stats["captures"])
        self.ready = True
        logger.info(
            "encoder %s on %s (%s): %d buckets, %d graphs captured in %.1fs (%.0f MiB pool), ready after %.1fs; "
            "batches up to %d patches / %d images (%s, %d in flight)",
            vision.name, self.device, vision.dtype, len(table), stats["captures"], stats["capture_seconds"],
            stats["capture_bytes"] / 2**20, time.perf_counter() - start, self.max_batch_patches,
            self.max_batch_images, a.batcher, self.pipeline_depth,
        )  # fmt: skip

    # -- batching limits ----------------------------------------------------------------------------------
    def _units(self, patches: int, images: int) -> int:
        return max(-(-patches * self.max_batch_images // self.max_batch_patches), images)

    def _batch_units(self, works: list[Work]) -> int:
        return self._units(sum(w.patches for w in works), sum(len(w.counts) for w in works))

    def _fits(self, patches: int, images: int) -> bool:
        return patches <= self.max_batch_patches and images <= self.max_batch_images

    def _keep(self, works: list[Work]) -> int:
        """How many of the queued `works` (in order) the next batch takes: the prefix with the most patches
        per (fixed cost + the budget of the bucket it replays), longer on ties. 17 224x224 images (4352
        patches) would replay the 8192 bucket at the cost of 32, so the batch takes 16 (4096, no padding)
        and the 17th leads the next one."""
        best, best_rate, patches, images = len(works), -1.0, 0, 0
        for k, w in enumerate(works, 1):
            patches, images = patches + w.patches, images + len(w.counts)
            key = self.engine.table.bucket_for(patches, images)
            rate = patches / (self._fixed_cost + (key.budget if key is not None else patches))
            if rate >= best_rate:
                best, best_rate = k, rate
        return best

    def _bucket_label(self, patches: int, images: int) -> str:
        key = self.engine.table.bucket_for(patches, images)
        return str(key.budget) if key is not None else "over"

    # -- the request methods -----------------------------------------------------------------------------
    async def encode_pixels(self, pixels, *, pooling: str = "mean", num_patches: int | None = None) -> list[np.ndarray]:
        """Encode resized uint8 images ([H, W, 3], sides multiples of patch*merge: `resize_image` output).

        Returns one float32 array per image: [out_dim] for `pooling="mean"`, [tokens, out_dim] for
        `"none"`. `num_patches` (total patches of the request) is what routers read; when given it must
        match the pixels.
        """
        entered = time.perf_counter()
        check_pooling(pooling)
        return await self._encode(Work(*check_pixels(pixels, self.pp), pooling), num_patches, entered)

    async def encode_llm_pixels(
        self, pixels, *, dtype: str = "float32", num_patches: int | None = None
    ) -> list[WireLLM]:
        """The LLM-ready outputs of resized uint8 images (as `encode_pixels`, same batches and device thread):
        per image `(tokens [n, out_dim], [DeepStack layer [n, out_dim], ...], (t, h, w))`, the arrays in the
        wire `dtype` (`deployments.llm_outputs`: float32, float16, or bfloat16 bit patterns as uint16),
        converted in the results thread. `[]` DeepStack layers for towers without them."""
        entered = time.perf_counter()
        check_dtype(dtype)
        return await self._encode(Work(*check_pixels(pixels, self.pp), "none", dtype), num_patches, entered)

    async def _encode(self, work: Work, num_patches: int | None, entered: float) -> list:
        total = work.patches
        if num_patches is not None and int(num_patches) != total:
            raise InvalidArgumentError(f"num_patches={num_patches} but the pixels have {total} patches")
        if not work.arrays:
            return []
        images = len(work.counts)
        label = self._bucket_label(total, images)
        self._queued[label] += 1
        self._queued_patches += total
        self.metrics.queue_depth.set(sum(self._queued.values()))
        try:
            if not self._fits(total, images):  # bigger than one batch: alone (the engine splits it)
                return (await self._run_batch([work]))[0]
            out = await self._submit(work)
            self._timings.add(request=time.perf_counter() - entered)
            return out
        finally:
            self._queued[label] -= 1
            if not self._queued[label]:
                del self._queued[label]
            self._queued_patches -= total

    async def _run_batch(self, works: list[Work]) -> list[list[np.ndarray]]:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            finish, launch_s = await loop.run_in_executor(self._executor, self._launch, works)
            results = await loop.run_in_executor(self._results, finish)
        except EncoderError:
            raise
        except Exception as e:
            if _sticky_device_error(e):
                self._fatal = e  # a sticky device error: fail health checks so Serve replaces this replica
            raise
        run_s, images = time.perf_counter() - started, sum(len(w.counts) for w in works)
        b = self._batches
        b["batches"] += 1
        b["batched_requests"] += len(works)
        b["batched_images"] += images
        b["busy_seconds"] += run_s
        b["launch_seconds"] += launch_s
        waits = [started - w.queued_at for w in works]
        self._timings.add(wait=sum(waits) / len(waits), launch=launch_s, results=run_s - launch_s, batch=run_s)
        self.metrics.batch(
            requests=len(works),
            images=images,
            patches=sum(w.patches for w in works),
            waits_s=waits,
            run_s=run_s,
            stats=self.engine.stats(),
        )
        return results

    @torch.inference_mode()
    def _launch(self, works: list[Work]):
        """Device thread: upload, patchify and queue the replays of one batch (one engine call per pooling mode
        or LLM wire dtype in it, usually one). Returns (a callable that waits for the outputs and splits them
        per request, the seconds spent here)."""
        self._wait_if_held()
        started = time.perf_counter()
        modes: dict[tuple[str, str | None], list[int]] = {}
        for i, w in enumerate(works):
            modes.setdefault((w.pooling, w.llm), []).append(i)
        pending = []
        for (pooling, llm), members in modes.items():
            arrays = [a for i in members for a in works[i].arrays]
            batch = stack_patchify(arrays, self.pp, self.device)
            if llm is None:
                p = self.engine.encode_async(batch, pooling)
            else:  # 16-bit wire types are cast on the device: half the bytes to copy, no host cast
                p = self.engine.encode_llm_async(batch, WIRE_TORCH_DTYPES[llm])
            pending.append((members, llm, p))

        def finish() -> list[list]:  # results thread
            out: list[list | None] = [None] * len(works)
            for members, llm, p in pending:
                outputs, pos = p.result(), 0
                if llm is None:
                    outputs = [v.numpy() for v in outputs]
                else:  # numpy views of the host buffer, already in the wire dtype (no copy)
                    outputs = wire_outputs(outputs, llm)
                for i in members:
                    n = len(works[i].arrays)
                    out[i] = outputs[pos : pos + n]
                    pos += n
            return out

        return finish, time.perf_counter() - started

    # -- control plane ---------------------------------------------------------------------------------------
    def record_routing_stats(self) -> dict:
        """Published to request routers (`RunningReplica.routing_stats`) every `routing_stats_period_s`.

        The keys `deployments.router.BucketRoutingStats` parses:
          buckets: this replica's bucket table, [[budget, max_images], ...] ascending.
          ready: the constructor finished, so every bucket graph is captured (always True once running).
          queued_by_bucket: {budget: requests inside this replica (queued or running) that map to that
            bucket alone}; requests above the largest bucket count under the largest budget.
        plus queued_requests / queued_patches (totals) for dashboards and tests.
        """
        largest = self.engine.table.largest.budget
        by_bucket: Counter[int] = Counter()
        for label, n in self._queued.items():
            by_bucket[largest if label == "over" else int(label)] += n
        return {
            "buckets": [[k.budget, k.max_images] for k in self.engine.table.keys],
            "ready": self.ready,
            "queued_by_bucket": dict(by_bucket),
            "queued_requests": sum(self._queued.values()),
            "queued_patches": self._queued_patches,
        }

    def record_replica_metadata(self) -> dict:
        """Published once when the replica starts, so routers know its table before the first stats poll."""
        return self.record_routing_stats()

    # -- health -----------------------------------------------------------------------------------------------
    def _probe(self) -> np.ndarray:
        """Worker thread: encode the probe image through the engine (a graph replay on CUDA)."""
        batch = stack_patchify(self._probe_pixels, self.pp, self.device)
        (vector,) = self.engine.encode(batch, pooling="mean")
        return vector.numpy()

    async def check_health(self) -> None:
        """Serve's health check (every `health_check_period_s`; 3 failures in a row and Serve replaces the
        replica): fails after a sticky device error, and otherwise runs a tiny real encode in the device
        thread (queued behind the running batch) and checks its output is finite and unchanged."""
        if self._fault == "unhealthy":
            self.metrics.health_checks.inc(tags={"result": "failed"})
            raise RuntimeError("encoder replica is unhealthy (injected fault)")
        if self._fatal is not None:
            self.metrics.health_checks.inc(tags={"result": "failed"})
            raise RuntimeError(f"encoder replica hit a device error and must be replaced: {self._fatal}")
        started = time.perf_counter()
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._executor, self._probe)
        except Exception as e:
            if _sticky_device_error(e):
                self._fatal = e
            self.metrics.health_checks.inc(tags={"result": "failed"})
            raise RuntimeError(f"health probe encode failed: {type(e).__name__}: {e}") from e
        self.metrics.health_probe.observe((time.perf_counter() - started) * 1000.0)
        if not np.isfinite(out).all() or not np.allclose(out, self._probe_ref, rtol=1e-3, atol=1e-3):
            self._fatal = RuntimeError("the health probe's embedding is not finite or differs from start-up")
            self.metrics.health_checks.inc(tags={"result": "failed"})
            raise RuntimeError(f"encoder replica must be replaced: {self._fatal}")
        self.metrics.health_checks.inc(tags={"result": "ok"})

    async def inject_fault(self, kind: str | None, switch=None, timeout_s: float = 60.0) -> str:
        """Tests only (`AppArgs.enable_fault_injection`); returns this replica's actor name
        (`ray.get_actor(name, namespace="serve")`), so a test knows which replica it hit.

        kind: "hold" — the next batch waits in the device thread (and every later one behind it) until
        `switch.wait.remote()` returns (an actor the test owns) or `timeout_s` passes; "unhealthy" —
        health checks fail; "corrupt" — the weights become NaN (a broken device state the health probe
        must detect); None — clear "hold" and "unhealthy".
        """
        if not self.args.enable_fault_injection:
            raise InvalidArgumentError("fault injection is disabled (AppArgs.enable_fault_injection)")
        if kind == "hold":
            if switch is None:
                raise InvalidArgumentError("inject_fault('hold') needs a switch actor with a wait() method")
            self._hold = (switch, timeout_s)
        elif kind == "unhealthy":
            self._fault = "unhealthy"
        elif kind == "corrupt":
            await asyncio.get_running_loop().run_in_executor(self._executor, self._corrupt)
        elif kind is None:
            self._fault, self._hold = None, None
        else:
            raise InvalidArgumentError(f"unknown fault {kind!r}; expected hold, unhealthy, corrupt or None")
        return serve.get_replica_context().replica_id.to_full_id_str()

    @torch.no_grad()
    def _corrupt(self) -> None:
        for p in self.engine.encoder.model.parameters():
            p.fill_(float("nan"))  # in place: captured graphs read the same memory

    def _wait_if_held(self) -> None:
        """Worker thread: block while a "hold" fault is set (released by its switch, or its timeout)."""
        hold = self._hold
        if hold is None:
            return
        switch, timeout_s = hold
        try:
            ray.get(switch.wait.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a lost switch or the timeout releases the hold too
            logger.warning("hold released by %s: %s", type(e).__name__, e)
        finally:
            if self._hold is hold:
                self._hold = None

    def __del__(self):
        # Serve calls this once the replica drained its requests (graceful shutdown); let the batch that
        # runs in the device thread finish rather than tear the engine down under it.
        for name in ("_executor", "_results"):
            executor = getattr(self, name, None)
            if executor is not None:
                executor.shutdown(wait=True)

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
            "out_dim": vision.out_dim,
            "default_pooling": vector_pooling(vision.config),
            "output_dims": {p: vision.output_dim(p) for p in POOLINGS if self._supports(p)},
            "deepstack_layers": self.deepstack_layers,
            "device": str(self.device),
            "dtype": str(vision.dtype).removeprefix("torch."),
            "preprocess": self.pp.model_dump(mode="json"),
            "buckets": [[k.budget, k.max_images] for k in self.engine.table.keys],
            "max_batch_patches": self.max_batch_patches,
            "max_batch_images": self.max_batch_images,
            "graphs_captured": self.ready,
            "replica_id": serve.get_replica_context().replica_id.unique_id,
        }

    def stats(self) -> dict:
        """The engine's counters (captures, replays per budget, eager runs, patches), this replica's batches
        (count, requests and images in them, busy seconds), queue state and the process's GIL switch interval."""
        replica = serve.get_replica_context().replica_id.unique_id
        return (
            self.engine.stats()
            | dict(self._batches)
            | self.record_routing_stats()
            | {
                "replica_id": replica,
                "gil_switch_interval_s": sys.getswitchinterval(),
                "pipeline_depth": self.pipeline_depth,
                "timings_ms": self._timings.p50_ms(),
            }
        )
