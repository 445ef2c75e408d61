"""`GraphEncoder`: a `VisionEncoder` whose forward runs through the bucket graphs.

Its table is `workspace.tables.engine_table` of the model, the given `buckets` and the attention backend's
`max_graph_tokens` (fixed-resolution towers: image-count tables; see that module). A model with text (CLIP,
SigLIP2 with its tokenizer) also gets its text tower's graphs: `workspace.text_runner`, table
`workspace.text_buckets`; `max_text_batch` is that table's largest batch, what callers size text batches by.
`images=False` builds the text side only (a text job: no image graphs captured, image calls refused).
"""

from __future__ import annotations

import torch

from encoder.api import VisionEncoder, l2_normalize, split_pooling
from encoder.attention import describe_backend, graph_token_cap, missing_faster_backend
from encoder.errors import ConfigError, InvalidArgumentError
from encoder.outputs import LLMOutput
from encoder.patch_batch import PatchBatch
from encoder.text_encoder import check_text_pooling, pool_text
from encoder.tokenization import check_texts
from workspace.runner import GraphRunner
from workspace.tables import engine_table, shape_of_encoder
from workspace.text_buckets import TextTable, text_table
from workspace.text_runner import TextGraphRunner


def max_image_patches(enc: VisionEncoder) -> int:
    """Patches of the largest image preprocessing can produce (max_pixels / patch area)."""
    if enc.model.patches_per_image is not None:
        return enc.model.patches_per_image
    pp = enc.preprocess_config
    return pp.max_pixels // (pp.patch_size**2)


def to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue a copy of device tensor `x` into pinned host memory; the event marks its completion.

    Pinned, so the copy is asynchronous (a pageable one would wait for the replays queued before it);
    the pinned block returns to torch's host cache only after the copy is done."""
    if x.device.type != "cuda":
        return x.cpu(), None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class _Pending:
    """Device work queued with its output copying to host memory (`to_host`); `done()` without waiting,
    `_wait()` blocks on the copy (releasing the GIL) and gives the host tensor (None: nothing was queued)."""

    def __init__(self, host: torch.Tensor | None, event):
        self._host, self._event = host, event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def _wait(self) -> torch.Tensor | None:
        if self._host is not None and self._event is not None:
            self._event.synchronize()
        return self._host


class PendingEncode(_Pending):
    """An encode whose device work may still run; `result()` waits for it."""

    def __init__(self, host: torch.Tensor | None, event, sizes: list[int] | None, l2: bool):
        super().__init__(host, event)
        self._sizes, self._l2 = sizes, l2

    def result(self) -> list[torch.Tensor]:
        """Per image, float32 CPU tensors (views of one host buffer), as `GraphEncoder.encode`."""
        host = self._wait()
        if host is None:
            return []
        if self._sizes is not None:  # tokens per image
            return list(torch.split(host, self._sizes))
        outs = list(host.unbind(0))
        return l2_normalize(outs) if self._l2 else outs


class PendingLLM(_Pending):
    """`encode_llm` whose device work may still run; `result()` waits and splits per image."""

    def __init__(
        self, host, event, sizes: list[int], layers: int, grid: list[list[int]], timestamps=None, per_grid=None
    ):
        super().__init__(host, event)
        self._sizes, self._layers, self._grid = sizes, layers, grid
        self._timestamps = timestamps  # per item, a Qwen3-VL video's seconds per temporal patch, else None
        self._per_grid = per_grid  # per item, a Qwen2/2.5-VL video's second_per_grid_ts, else None

    def result(self) -> list[LLMOutput]:
        host = self._wait()
        if host is None:
            return []
        # host: [(1 + layers) * total, out_dim]: tokens, then each DeepStack layer, each packed per image
        planes = host.view(1 + self._layers, -1, host.shape[-1]).unbind(0)
        split = [torch.split(p, self._sizes) for p in planes]
        stamps = self._timestamps or [None] * len(self._sizes)
        per_grid = self._per_grid or [None] * len(self._sizes)
        return [
            LLMOutput(
                split[0][i],
                tuple(self._grid[i]),
                [split[k][i] for k in range(1, 1 + self._layers)],
                stamps[i],
                per_grid[i],
            )
            for i in range(len(self._sizes))
        ]


class PendingText(_Pending):
    """`encode_text_ids` whose device work may still run; `result()` waits and pools per text."""

    def __init__(self, host: torch.Tensor | None, event, pooling: str):
        super().__init__(host, event)
        self._pooling = pooling

    def result(self) -> list[torch.Tensor]:
        """Per text, one float32 CPU vector [out_dim], as `GraphEncoder.encode_text_ids`."""
        host = self._wait()
        return [] if host is None else pool_text(host, self._pooling)


class GraphEncoder:
    """Same `preprocess` / `encode` as `VisionEncoder`; captures every bucket at construction.

    `buckets`: a `BucketTable`, a spec `BucketTable.parse` accepts ("256,1024", "pow2:256-32768"),
    or None for the default table. On a machine without CUDA the same packing runs eagerly.
    `images=False`: the text side only (a model with text): no image table, runner or graphs, and the image
    calls (`encode`, `encode_llm` and their async forms) raise `ConfigError`.
    """

    def __init__(
        self,
        vision_encoder: VisionEncoder,
        buckets=None,
        *,
        debug: bool = False,
        pad_mlp: int = 128,
        text_graphs: bool = True,
        text_buckets: TextTable | None = None,
        images: bool = True,
    ):
        self.encoder = vision_encoder
        self.images = images
        if not images and not vision_encoder.supports_text:
            raise ConfigError(
                f"GraphEncoder(images=False) builds the text side only, but model {vision_encoder.name!r} takes no "
                "text (no text tower with its tokenizer)"
            )
        self.table = self.runner = None
        if images:
            tower = vision_encoder.model
            if vision_encoder.device.type == "cuda":
                # exact layout changes (zero-padded MLP width, fused GEMMs) built as new modules;
                # the eager encoder shares the model and stays equal
                tower.fuse(pad_mlp)
            cap = graph_token_cap(tower.backends)
            self.table = engine_table(shape_of_encoder(vision_encoder), buckets, cap)
            self.runner = GraphRunner(
                tower, self.table, max_image_patches=max_image_patches(vision_encoder), debug=debug
            )
        # the text tower's graphs (a model with text): captured now on CUDA into the image graphs' pool (a pool of
        # their own when text-only), unless `text_graphs=False` (then its buckets run eagerly); `text_buckets`:
        # None for the default table
        self.text_runner: TextGraphRunner | None = None
        if vision_encoder.supports_text:
            text_tower = vision_encoder.text.tower
            table = (
                text_buckets if text_buckets is not None else text_table(text_tower.seq_len, text_tower.prefix_exact)
            )
            use = None if text_graphs else False
            pool, lock = (self.runner.pool, self.runner.lock) if self.runner is not None else (None, None)
            self.text_runner = TextGraphRunner(text_tower, table, use_graphs=use, pool=pool, lock=lock, debug=debug)

    def _image_runner(self) -> GraphRunner:
        if self.runner is None:
            raise ConfigError(
                f"this GraphEncoder of {self.encoder.name!r} was built for text only (images=False): it has no image "
                "graphs; build one with images=True to encode images"
            )
        return self.runner

    @property
    def config(self):
        return self.encoder.config

    @property
    def out_dim(self) -> int:
        return self.encoder.out_dim

    @property
    def default_pooling(self) -> str:
        return self.encoder.default_pooling

    def output_dim(self, pooling: str | None = None) -> int:
        return self.encoder.output_dim(pooling)

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    def preprocess(self, images) -> PatchBatch:
        return self.encoder.preprocess(images)

    def preprocess_video(self, videos, fps: float | None = None) -> PatchBatch:
        """`VisionEncoder.preprocess_video`: videos (bytes, paths, uint8 frame arrays) -> a PatchBatch that
        `encode` / `encode_llm` take; a video's frames are packed into the bucket graphs as images are."""
        return self.encoder.preprocess_video(videos, fps)

    @torch.inference_mode()
    def encode(self, images, pooling: str | None = None) -> list[torch.Tensor]:
        """Per image, float32 CPU tensors, as `VisionEncoder.encode`: tokens ("none"), their mean
        ("mean"), the model's embedding ("model", CLIP / SigLIP), "-l2" for L2-normalised vectors.
        `pooling=None` is the model's default."""
        return self.encode_async(images, pooling).result()

    @torch.inference_mode()
    def encode_async(self, images, pooling: str | None = None) -> PendingEncode:
        """`encode` without waiting for the device: the replays and the copy of the outputs to pinned host
        memory are queued on the current stream, and `result()` waits for them. So the host can prepare
        (upload, patchify, pack) the next batch while this one replays. Inputs are not needed after this
        returns; on a machine without CUDA the work is done here and `result()` only splits it."""
        runner = self._image_runner()
        pooling = self.encoder.resolve_pooling(pooling)
        base, l2 = split_pooling(pooling)
        batch = images if isinstance(images, PatchBatch) else self.preprocess(images)
        if batch.num_images == 0:
            return PendingEncode(None, None, [], l2)
        self.encoder.check_batch(batch)
        out = runner.run_all(batch.pixel_values, batch.grid_thw)
        if base == "model":
            flat, sizes = out.pooled, None
        elif base == "mean":
            flat, sizes = out.means, None
        else:
            flat = torch.cat(out.tokens).float()  # one device-to-host copy
            sizes = [t.shape[0] for t in out.tokens]
        host, event = to_host(flat)
        return PendingEncode(host, event, sizes, l2)

    @torch.inference_mode()
    def encode_llm(self, images, dtype: torch.dtype = torch.float32) -> list[LLMOutput]:
        """Per image, the LLM-ready outputs (`encoder.outputs.LLMOutput`), as `VisionEncoder.encode_llm`;
        `dtype` of the returned tensors (float32, or a 16-bit type cast on the device)."""
        return self.encode_llm_async(images, dtype).result()

    @torch.inference_mode()
    def encode_llm_async(self, images, dtype: torch.dtype = torch.float32) -> PendingLLM:
        """`encode_llm` without waiting for the device (see `encode_async`): one copy to pinned host memory,
        cast to `dtype` on the device first (bfloat16 from a bf16 tower: its own values, half the bytes to
        copy, and no cast left for the host)."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            shown = f"{type(dtype).__name__} {dtype!r}" if not isinstance(dtype, torch.dtype) else str(dtype)
            raise InvalidArgumentError(f"dtype must be a floating-point torch.dtype (torch.float32, ...), got {shown}")
        runner = self._image_runner()
        batch = images if isinstance(images, PatchBatch) else self.preprocess(images)
        if batch.num_images == 0:
            return PendingLLM(None, None, [], 0, [])
        self.encoder.check_batch(batch)
        out = runner.run_all(batch.pixel_values, batch.grid_thw)
        layers = len(out.deepstack[0])
        flat = torch.cat(out.tokens + [d[k] for k in range(layers) for d in out.deepstack]).to(dtype)
        host, event = to_host(flat)
        sizes = [t.shape[0] for t in out.tokens]
        return PendingLLM(
            host, event, sizes, layers, batch.grid_thw.tolist(), batch.timestamps, batch.second_per_grid_ts
        )

    # -- text (CLIP / SigLIP checkpoints with their tokenizer) ---------------------------------
    @property
    def supports_text(self) -> bool:
        """True when `encode_text` works (the wrapped `VisionEncoder`'s)."""
        return self.encoder.supports_text

    @property
    def max_text_batch(self) -> int | None:
        """The most texts one text graph holds (its table's largest batch; more are run in chunks of it): what a
        caller sizes its text batches by. None for a model without text."""
        return self.text_runner.table.batches[-1] if self.text_runner is not None else None

    def text_tokens(self, texts: list[str]) -> list[int]:
        """Per text, its real (non-pad) tokens after truncation, special tokens included (`usage.prompt_tokens`)."""
        return self.encoder.text_tokens(texts)

    @torch.inference_mode()
    def encode_text(self, texts: list[str], pooling: str | None = None) -> list[torch.Tensor]:
        """Per text, one float32 CPU vector [out_dim], as `VisionEncoder.encode_text` (same poolings and errors)."""
        text = self.encoder.text_side()
        pooling = check_text_pooling(pooling)
        texts = check_texts(texts)
        if not texts:
            return []
        ids, mask = text.tokenize(texts)
        return self.encode_text_ids(ids, mask, pooling)

    @torch.inference_mode()
    def encode_text_ids(self, ids: torch.Tensor, mask: torch.Tensor, pooling: str | None = None) -> list[torch.Tensor]:
        """`encode_text` of pre-tokenized texts: `ids` and `mask` [B, seq_len] int64, as the model's tokenizer
        writes them (`VisionEncoder.text.tokenize`). InvalidArgumentError naming `ids` / `mask` for a bad input."""
        return self.encode_text_ids_async(ids, mask, pooling).result()

    @torch.inference_mode()
    def encode_text_ids_async(self, ids: torch.Tensor, mask: torch.Tensor, pooling: str | None = None) -> PendingText:
        """`encode_text_ids` without waiting for the device (as `encode_async`): the replays and the copy of the
        outputs to pinned host memory are queued, `result()` waits for them and pools. Inputs are checked here
        (the same errors); they are not needed after this returns."""
        text = self.encoder.text_side()
        pooling = check_text_pooling(pooling)
        ids, mask = text.check_ids(ids, mask)
        if ids.shape[0] == 0:
            return PendingText(None, None, pooling)
        out = self.text_runner.run(ids, mask)  # [B, out_dim] float32, device
        host, event = to_host(out)
        return PendingText(host, event, pooling)

    def attention_hint(self) -> str | None:
        """A faster attention backend this GPU would run with `auto` but which is not installed, and how to
        install it (for the start-up line); None when there is none."""
        return missing_faster_backend(self.encoder.model.backends, self.encoder.device)

    def stats(self) -> dict:
        """The runner's counters (none when text-only), plus the attention backend of each layer kind (for `auto`:
        which backend ran which graph shapes' segment bounds), and the text graphs' counters under "text"."""
        kinds = {kind: describe_backend(b) for kind, b in self.encoder.model.backends.items()}
        out = {**(self.runner.stats.as_dict() if self.runner is not None else {}), "attention": kinds}
        if self.text_runner is not None:  # the text graphs' counters, under their own key
            out["text"] = self.text_runner.stats.as_dict()
        return out
