"""An encoder replica's batching and device pipeline.

`DevicePipeline.submit(work)` queues one request (a `deployments.wire.EncodeRequest`); a batcher merges
queued requests (from any number of callers) into one batch of at most `max_batch_patches` patches /
`max_batch_images` images (`batcher="continuous"`: `deployments.batching.ContinuousBatcher`, a batch is
whatever waits when a slot frees; `batcher="serve"`: `@serve.batch` with a patch-counting `batch_size_fn`).
A batch runs in two threads, never on the event loop (which keeps answering the router's queue-length
probes): the device thread uploads the uint8 pixels, normalises and patchifies them on the device and
queues one `GraphEncoder.encode_async` per output form in the batch (`wire.group`; the bucket replays); the
results thread waits for that device work and splits the outputs per request. With `pipeline_depth` 2 the
device thread prepares batch N+1 while batch N replays, so the GPU does not idle through the host's part of
every batch.

Texts (`wire.TextRequest`, models with a text tower) queue in a batcher of their own, never in an image batch:
their size is tokens (every text runs at the tower's fixed length, `text_seq_len`), at most `max_batch_texts` a
batch (the engine's `GraphEncoder.max_text_batch`: its largest text graph). They are tokenized here, in the device
thread, with the model's own tokenizer: the replica holds it with the text weights (a Hub checkpoint's tokenizer
files are on the replica's node, not the ingress's), and the tokenizer (Rust, `tokenizers`) costs microseconds per
text beside the tower. The ingress therefore sizes a text by the tower's length, not its real tokens; the real
count (the attention mask) comes back with each vector for `usage.prompt_tokens`. A text batch is queued as an
image batch is (`GraphEncoder.encode_text_ids_async`), so the device thread prepares the next batch while its
graphs replay.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from ray import serve

from deployments.batching import ContinuousBatcher
from deployments.llm_outputs import wire_outputs, wire_torch_dtype
from deployments.metrics import RecentTimings, ReplicaMetrics
from deployments.replica.health import sticky_device_error
from deployments.wire import EncodeRequest, TextRequest, group, patch_count
from encoder.errors import EncoderError, InvalidArgumentError, InvalidImageError, InvalidVideoError
from encoder.patchify import stack_patchify
from encoder.preprocessing.config import ProcessorConfig
from workspace import GraphEncoder
from workspace.buckets import BucketTable
from workspace.graph_encoder import PendingText
from workspace.tables import BucketPlan

# Wall clocks of the ingress and encoder hosts may differ a little: the encoder drops work only this long
# after its deadline (the ingress has cancelled it by then anyway; this is the backstop for a lost cancel
# or a caller that died).
_DEADLINE_GRACE_S = 1.0


_TEXT = "text"  # the queue label of text requests (in no image bucket)


def engine_delta(before: dict, after: dict) -> dict:
    """What `GraphEncoder.stats()` counters gained between two snapshots: padded patches, eager runs, replays
    per budget (only the budgets that ran)."""
    replays = {b: n - before["replays"].get(b, 0) for b, n in after["replays"].items()}
    return {
        "padded_patches": after["padded_patches"] - before["padded_patches"],
        "eager_runs": after["eager_runs"] - before["eager_runs"],
        "replays": {b: n for b, n in replays.items() if n},
    }


def _expired(work: EncodeRequest) -> bool:
    return work.deadline is not None and time.time() > work.deadline + _DEADLINE_GRACE_S


def _expired_error(work: EncodeRequest) -> TimeoutError:
    return TimeoutError(f"the request's deadline passed {time.time() - work.deadline:.1f}s ago; dropped unrun")


def check_pixels(pixels, pp: ProcessorConfig, video_cfg=None) -> tuple[list[np.ndarray], list[int]]:
    """Validate resized uint8 images and count their patches (cheap: shapes only). With `video_cfg` (the
    model's video processor, `VisionEncoder.video_config`) a uint8 [n, h, w, 3] array is a video's sampled,
    resized frames: ceil(n / temporal_patch_size) x (h / P) x (w / P) patches (`wire.patch_count`)."""
    if isinstance(pixels, np.ndarray | torch.Tensor):
        raise InvalidArgumentError("pixels must be a list of uint8 [H, W, 3] arrays, not one array")
    arrays, counts = [], []
    for i, x in enumerate(pixels):
        if isinstance(x, torch.Tensor):
            x = x.cpu().numpy()
        if isinstance(x, np.ndarray) and x.ndim == 4:
            arrays.append(_check_video_pixels(i, x, video_cfg))
            counts.append(patch_count(x, video_cfg.patch_size, video_cfg.temporal_patch_size))
            continue
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


def _check_video_pixels(i: int, x: np.ndarray, video_cfg) -> np.ndarray:
    if video_cfg is None:
        raise InvalidVideoError(f"pixels[{i}]: a video's frames {x.shape}, but this model takes no video")
    n, h, w, c = x.shape
    if x.dtype != np.uint8 or c != 3 or n == 0 or h == 0 or w == 0 or h % video_cfg.factor or w % video_cfg.factor:
        raise InvalidVideoError(
            f"pixels[{i}]: expected a video's uint8 [frames, H, W, 3] frames with sides non-zero multiples of "
            f"{video_cfg.factor}, got {x.dtype} {x.shape}"
        )
    return x


def best_prefix(works: list[EncodeRequest], table: BucketTable, fixed_cost: int) -> int:
    """How many of the queued `works` (in order) the next batch takes: the prefix with the most patches per
    (fixed cost + the budget of the bucket it replays), longer on ties. 17 224x224 images (4352 patches)
    would replay the 8192 bucket at the cost of 32, so the batch takes 16 (4096, no padding) and the 17th
    leads the next one."""
    best, best_rate, patches, images = len(works), -1.0, 0, 0
    for k, w in enumerate(works, 1):
        patches, images = patches + w.patches, images + len(w.counts)
        key = table.bucket_for(patches, images)
        rate = patches / (fixed_cost + (key.budget if key is not None else patches))
        if rate >= best_rate:
            best, best_rate = k, rate
    return best


class DevicePipeline:
    """Batches an encoder replica's requests and runs them on its device (see the module docstring).

    `before_launch` (optional) runs in the device thread before each batch (test fault injection holds
    batches there). `fatal` is set after a sticky device error: the replica must fail its health checks.
    """

    def __init__(
        self,
        engine: GraphEncoder,
        plan: BucketPlan,
        *,
        batcher: str,
        pipeline_depth: int,
        fixed_cost: int | None,
        batch_wait_timeout_s: float,
        metrics: ReplicaMetrics,
        before_launch: Callable[[], None] | None = None,
    ):
        self.engine, self.pp, self.device = engine, engine.encoder.preprocess_config, engine.device
        self.max_batch_patches, self.max_batch_images = plan.max_batch_patches, plan.max_batch_images
        # the text side: its fixed length (0: the model takes no text) and batch limit, the most texts one of the
        # engine's text graphs holds (a request of more runs alone, the engine taking it in chunks of that)
        text = engine.encoder.text if engine.supports_text else None
        self.text_seq_len = text.config.seq_len if text is not None else 0
        self.max_batch_texts = engine.max_text_batch or 0
        self.pipeline_depth = pipeline_depth
        self.metrics = metrics
        self.fatal: BaseException | None = None
        self._before_launch = before_launch
        self._device_thread = ThreadPoolExecutor(1, thread_name_prefix="encoder-device")
        self._results_thread = ThreadPoolExecutor(1, thread_name_prefix="encoder-results")
        self._queued: Counter[str] = Counter()  # requests inside the replica, by bucket label
        self._queued_patches = 0
        # batches run, requests and images in them; seconds from launch to results (overlapping batches both
        # count) and seconds the device thread spent preparing and queueing them
        self.batches = {
            "batches": 0, "batched_requests": 0, "batched_images": 0, "busy_seconds": 0.0, "launch_seconds": 0.0,
        }  # fmt: skip
        # the last requests (time inside this replica) and batches (queue wait, device thread, results)
        self.timings = RecentTimings()
        # Trim batches to the prefix with the most patches per unit of replay cost (graphs only: on the CPU
        # the engine runs images one by one, so a longer batch costs nothing extra).
        self._fixed_cost = fixed_cost
        self._submit_text = ContinuousBatcher(self._run_batch, self._text_fits, pipeline_depth, expired=_expired)
        if batcher == "continuous":
            keep = self._keep if fixed_cost else None
            self._submit = ContinuousBatcher(self._run_batch, self._fits, pipeline_depth, keep=keep, expired=_expired)
        else:
            # Batch "size" in image slots: max(patches scaled so the patch limit equals the image limit,
            # images). One number enforces both limits and stays <= max_ongoing_requests.
            self._submit = serve.batch(
                max_batch_size=self.max_batch_images,
                batch_wait_timeout_s=batch_wait_timeout_s,
                max_concurrent_batches=pipeline_depth,
                batch_size_fn=self._batch_units,
            )(self._run_batch)

    # -- batching limits ----------------------------------------------------------------------------------
    def _units(self, patches: int, images: int) -> int:
        return max(-(-patches * self.max_batch_images // self.max_batch_patches), images)

    def _batch_units(self, works: list[EncodeRequest]) -> int:
        return self._units(sum(w.patches for w in works), sum(len(w.counts) for w in works))

    def _fits(self, patches: int, images: int) -> bool:
        return patches <= self.max_batch_patches and images <= self.max_batch_images

    def _text_fits(self, tokens: int, texts: int) -> bool:
        return texts <= self.max_batch_texts

    def _keep(self, works: list[EncodeRequest]) -> int:
        return best_prefix(works, self.engine.table, self._fixed_cost)

    def _bucket_label(self, patches: int, images: int) -> str:
        key = self.engine.table.bucket_for(patches, images)
        return str(key.budget) if key is not None else "over"

    # -- requests -------------------------------------------------------------------------------------------
    async def submit(self, work: EncodeRequest | TextRequest, entered: float) -> list:
        """The request's outputs, per image or text (`entered`: when the request reached the replica)."""
        total, images = work.patches, len(work.counts)
        text = isinstance(work, TextRequest)
        label = _TEXT if text else self._bucket_label(total, images)
        self._queued[label] += 1
        self._queued_patches += total
        self.metrics.queue_depth.set(sum(self._queued.values()))
        try:
            if _expired(work):
                raise _expired_error(work)
            fits, submit = (self._text_fits, self._submit_text) if text else (self._fits, self._submit)
            if not fits(total, images):  # bigger than one batch: alone (the engine splits it)
                return (await self._run_batch([work]))[0]
            out = await submit(work)
            self.timings.add(request=time.perf_counter() - entered)
            return out
        finally:
            self._queued[label] -= 1
            if not self._queued[label]:
                del self._queued[label]
            self._queued_patches -= total
            self.metrics.queue_depth.set(sum(self._queued.values()))  # it stayed at a burst's peak

    def queued_by_bucket(self) -> dict[int, int]:
        """{budget: requests inside this replica (queued or running) that map to that bucket alone};
        requests above the largest bucket count under the largest budget; text requests are in no bucket."""
        largest = self.engine.table.largest.budget
        by_bucket: Counter[int] = Counter()
        for label, n in self._queued.items():
            if label != _TEXT:
                by_bucket[largest if label == "over" else int(label)] += n
        return dict(by_bucket)

    def queue_totals(self) -> dict[str, int]:
        """Requests inside this replica (images and texts), their patches (texts: their tokens), the text requests."""
        return {
            "queued_requests": sum(self._queued.values()),
            "queued_patches": self._queued_patches,
            "queued_text_requests": self._queued.get(_TEXT, 0),
        }

    async def on_device_thread(self, fn: Callable, *args):
        """`fn(*args)` in the device thread, queued behind the batches already there."""
        return await asyncio.get_running_loop().run_in_executor(self._device_thread, fn, *args)

    # -- one batch ------------------------------------------------------------------------------------------
    async def _run_batch(self, works: list[EncodeRequest]) -> list[list[np.ndarray]]:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            launched = self._device_thread.submit(self._launch, works)
            try:
                finish, launch_s, engine_delta = await asyncio.wrap_future(launched)
            except asyncio.CancelledError:
                # the callers are gone (deadline, disconnect): a batch still queued for the device thread is
                # dropped; one already launched has its outputs collected for nobody (the device's work and
                # buffers are released in order, as for any batch)
                if not launched.cancelled():
                    launched.add_done_callback(self._collect_for_nobody)
                raise
            results = await asyncio.shield(loop.run_in_executor(self._results_thread, finish))
        except EncoderError:
            raise
        except Exception as e:
            if sticky_device_error(e):
                self.fatal = e  # a sticky device error: fail health checks so Serve replaces this replica
            raise
        run_s, images = time.perf_counter() - started, sum(len(w.counts) for w in works)
        b = self.batches
        b["batches"] += 1
        b["batched_requests"] += len(works)
        b["batched_images"] += images
        b["busy_seconds"] += run_s
        b["launch_seconds"] += launch_s
        waits = [started - w.queued_at for w in works]
        self.timings.add(wait=sum(waits) / len(waits), launch=launch_s, results=run_s - launch_s, batch=run_s)
        self.metrics.batch(
            requests=len(works),
            images=images,
            patches=sum(w.patches for w in works),
            waits_s=waits,
            run_s=run_s,
            engine=engine_delta,
        )
        return results

    def _collect_for_nobody(self, launched) -> None:
        if not launched.cancelled() and launched.exception() is None:
            self._results_thread.submit(launched.result()[0])

    @torch.inference_mode()
    def _launch(self, works: list[EncodeRequest]):
        """Device thread: upload, patchify and queue the replays of one batch (one engine call per pooling mode
        or LLM wire dtype in it, usually one). Returns (a callable that waits for the outputs and splits them
        per request, the seconds spent here, and what the engine's counters gained from this batch alone: the
        health probe's encodes run in this thread too, between batches, and are not requests)."""
        if self._before_launch is not None:
            self._before_launch()
        started = time.perf_counter()
        before = self.engine.stats()
        groups = group(works)  # one engine call per output form (pooling or LLM wire dtype), usually one
        pending = []
        for g in groups:
            if isinstance(g.merged, TextRequest):
                pending.append((g, self._launch_texts(g.merged)))
                continue
            batch = stack_patchify(g.merged.arrays, self.pp, self.device, self.engine.encoder.video_config)
            if g.merged.llm is None:
                p = self.engine.encode_async(batch, g.merged.pooling)
            else:  # 16-bit wire types are cast on the device: half the bytes to copy, no host cast
                p = self.engine.encode_llm_async(batch, wire_torch_dtype(g.merged.llm))
            pending.append((g, p))

        def finish() -> list[list]:  # results thread
            out: list[list | None] = [None] * len(works)
            for g, p in pending:
                if isinstance(g.merged, TextRequest):
                    text_pending, tokens = p
                    outputs = [(v.numpy(), n) for v, n in zip(text_pending.result(), tokens, strict=True)]
                elif g.merged.llm is None:
                    outputs = [v.numpy() for v in p.result()]
                else:  # numpy views of the host buffer, already in the wire dtype (no copy)
                    outputs = wire_outputs(p.result(), g.merged.llm)
                g.scatter(outputs, works, out)
            return out

        return finish, time.perf_counter() - started, engine_delta(before, self.engine.stats())

    def _launch_texts(self, work: TextRequest) -> tuple[PendingText, list[int]]:
        """Device thread: tokenize (the model's tokenizer: padded and cut to the tower's length) and queue the text
        tower's replays; the pending vectors (`result()` in the results thread) and per text its real tokens (the
        attention mask's ones)."""
        ids, mask = self.engine.encoder.text_side().tokenize(work.texts)
        tokens = mask.sum(1).tolist()
        return self.engine.encode_text_ids_async(ids, mask, work.pooling), tokens

    def shutdown(self) -> None:
        """Let the batch running in the device thread finish rather than tear the engine down under it."""
        for executor in (self._device_thread, self._results_thread):
            executor.shutdown(wait=True)
