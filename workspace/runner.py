"""`GraphRunner`: packs images into buckets and runs each bucket as a captured CUDA graph.

Every bucket of the table is captured in the constructor, largest first, into one shared memory
pool. A batch is split into packs (`BucketTable.pack`); each pack is written into its bucket's
`Workspace` and replayed. Packs no bucket fits (an image above the largest budget or above the
per-image bound) run eagerly through the same body. Without CUDA nothing is captured and every
pack runs that body eagerly, so CPU tests exercise packing, padding and geometry.

Fixed-resolution towers (CLIP, SigLIP; a tower with `patches_per_image`) run through the same
runner: every image is L patches, so a bucket is an image count n (budget n * L, max_images n) and
packing by patch count is packing by image count. Their body computes `cu_seqlens` inside the graph
from `frames_hw` (real image slots first, the rest empty segments) and also writes each slot's
model embedding (`Workspace.pooled`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from encoder.geometry import compute_meta, count_windows, frames_of
from encoder.qwen import QwenVisionTower
from encoder.vit import VitTower
from workspace.buckets import BucketKey, BucketTable, Pack
from workspace.buffers import Workspace


class GraphCaptureError(RuntimeError):
    """The bucket graphs could not be captured (out of memory, unsupported op)."""


@dataclass
class RunOutput:
    """What one `run_all` returns, per image in input order."""

    tokens: list[torch.Tensor]  # [n_i, dim] each, device, model dtype (CLIP: float32)
    means: torch.Tensor  # [N, dim] float32
    pooled: torch.Tensor | None  # [N, out_dim] float32 model embeddings (CLIP / SigLIP), else None


@dataclass
class RunnerStats:
    captures: int = 0
    capture_seconds: float = 0.0
    capture_bytes: int = 0  # graph pool memory reserved by the captures
    workspace_bytes: int = 0
    replays: Counter = field(default_factory=Counter)  # budget -> replays
    eager_runs: int = 0
    real_patches: int = 0
    padded_patches: int = 0
    images: int = 0

    def as_dict(self) -> dict:
        return {
            "captures": self.captures,
            "capture_seconds": round(self.capture_seconds, 3),
            "capture_bytes": self.capture_bytes,
            "workspace_bytes": self.workspace_bytes,
            "replays": dict(sorted(self.replays.items())),
            "eager_runs": self.eager_runs,
            "real_patches": self.real_patches,
            "padded_patches": self.padded_patches,
            "images": self.images,
        }


class GraphRunner:
    def __init__(
        self,
        tower: QwenVisionTower | VitTower,
        table: BucketTable,
        max_image_patches: int,
        *,
        use_graphs: bool | None = None,
        debug: bool = False,
    ):
        self.tower = tower
        self.cfg = tower.cfg
        self.table = table
        self.device = next(tower.parameters()).device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.debug = debug
        self.max_image_patches = max_image_patches
        self.stats = RunnerStats()
        self.workspaces: dict[BucketKey, Workspace] = {}
        self.graphs: dict[BucketKey, torch.cuda.CUDAGraph] = {}
        self._lock = threading.Lock()
        # fixed-resolution towers: patches per image (every bucket is a whole number of images)
        self.fixed: int | None = getattr(tower, "patches_per_image", None)
        for key in table.keys:
            if self.fixed is not None and key.budget != key.max_images * self.fixed:
                raise GraphCaptureError(
                    f"bucket {key} does not hold whole images of {self.fixed} patches; a fixed-resolution tower "
                    "needs buckets of n images x patches per image (workspace.graph_encoder.image_count_table)"
                )
            if key.budget % self.cfg.merge_unit:
                raise GraphCaptureError(f"bucket budget {key.budget} is not a multiple of {self.cfg.merge_unit}")
        if self.use_graphs:
            self._capture_all()

    # -- the body every bucket runs (captured, or eager on CPU) --------------------------------
    def _body(self, ws: Workspace, bounds: tuple[int, int] | None = None) -> None:
        # geometry from the small per-frame table, inside the graph: no host reads of image data.
        # `bounds` (max_seqlen, window_slots) tightens the static bounds when nothing is captured:
        # same buffers and padding, but attention sized to the batch (the CPU reference attention
        # costs memory quadratic in these bounds)
        if self.fixed is not None:
            return self._body_fixed(ws)
        max_seqlen, window_slots = bounds or (ws.max_seqlen, ws.window_slots)
        meta = compute_meta(ws.frames_hw, ws.key.budget, self.cfg, max_seqlen, window_slots)
        tokens = self.tower(ws.pixel_values, meta)  # [budget / mu, out_dim]
        # per-image mean pooling as data too: token -> frame via the full-attention boundaries
        mu = self.cfg.merge_unit
        ends = meta.cu_seqlens[1:].long() // mu
        t = torch.arange(tokens.shape[0], device=tokens.device)
        img = torch.searchsorted(ends, t, right=True)
        real = img < ws.key.max_images
        sums = torch.zeros(ws.key.max_images + 1, tokens.shape[1], dtype=torch.float32, device=tokens.device)
        sums.index_add_(0, torch.where(real, img, ws.key.max_images), tokens.float())
        counts = (ends - torch.nn.functional.pad(ends[:-1], (1, 0))).clamp(min=1)
        means = sums[:-1] / counts[:, None]
        if ws.tokens is None:
            ws.tokens, ws.means, ws.meta = tokens, means, meta
        else:
            ws.tokens.copy_(tokens)
            ws.means.copy_(means)

    def _body_fixed(self, ws: Workspace) -> None:
        # CLIP / SigLIP: segments from the real image slots, computed from data inside the graph
        cu_seqlens = self.tower.segments(ws.frames_hw)
        tokens, pooled = self.tower(ws.pixel_values, cu_seqlens)  # [budget, dim], [max_images, out_dim]
        # per-slot means: padding slots are whole images of stale rows, never mixed with real ones
        means = tokens.view(ws.key.max_images, self.fixed, -1).float().mean(1)
        if ws.tokens is None:
            ws.tokens, ws.means, ws.pooled = tokens, means, pooled
        else:
            ws.tokens.copy_(tokens)
            ws.means.copy_(means)
            ws.pooled.copy_(pooled)

    def _workspace(self, key: BucketKey) -> Workspace:
        ws = self.workspaces.get(key)
        if ws is None:
            # normal tensors even when first needed under inference_mode: tests and debug tools
            # may write into them later
            with torch.inference_mode(False):
                ws = Workspace.allocate(
                    key, self.cfg.patch_dim, self.max_image_patches, self.cfg.merge_unit, self.device
                )
            self.workspaces[key] = ws
        return ws

    def _fill_dummy(self, ws: Workspace) -> None:
        # a valid geometry for warm-up and capture: one image spanning the budget (2 x budget/2)
        # or, when the bucket bounds one image's size, as many bound-size images as fit
        m = self.cfg.spatial_merge_size
        ws.pixel_values.normal_()
        ws.frames_hw.zero_()
        if self.fixed is not None:  # every image slot real
            ws.frames_hw.copy_(torch.tensor([self.cfg.grid, self.cfg.grid]).expand_as(ws.frames_hw))
            return
        rows = max(1, min(ws.key.max_images, -(-ws.key.budget // ws.max_seqlen)))
        per = ws.key.budget // rows // (m * m) * (m * m)
        for i in range(rows):
            ws.frames_hw[i] = torch.tensor([m, per // m])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved(self.device)
        ws_bytes = 0
        for key in sorted(self.table.keys, key=lambda k: k.budget, reverse=True):
            ws = self._workspace(key)
            ws_bytes += ws.pixel_values.nbytes + ws.frames_hw.nbytes
            self._fill_dummy(ws)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body(ws)  # warm-up: kernel JIT, cuBLAS workspaces, first allocations
                ws.tokens = ws.means = ws.meta = ws.pooled = None
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self._body(ws)
            except torch.OutOfMemoryError as exc:
                raise GraphCaptureError(
                    f"out of GPU memory capturing bucket {key}; use smaller budgets or fewer buckets"
                ) from exc
            ws.captured_ptrs = ws.input_ptrs()
            self.graphs[key] = graph
            self.stats.captures += 1
        torch.cuda.synchronize()
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.workspace_bytes = ws_bytes
        self.stats.capture_bytes = torch.cuda.memory_reserved(self.device) - before - ws_bytes

    # -- running a batch ---------------------------------------------------------------------
    def _fits(self, pack: Pack, counts: list[int]) -> bool:
        return pack.key is not None and all(counts[i] <= self.max_image_patches for i in pack.indices)

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Tokens per image ([n_i, out_dim] each, device, model dtype) and means [N, out_dim] float32."""
        out = self.run_all(pixel_values, grid_thw)
        return out.tokens, out.means

    def run_all(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> RunOutput:
        """Tokens and means per image, plus the model embeddings of a CLIP / SigLIP tower."""
        grid = grid_thw.tolist()
        counts = [t * h * w for t, h, w in grid]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        out_tokens: list[torch.Tensor | None] = [None] * len(counts)
        out_means: list[torch.Tensor | None] = [None] * len(counts)
        out_pooled: list[torch.Tensor | None] = [None] * len(counts)
        with self._lock:
            for pack in self.table.pack(counts):
                frames_ok = all(grid[i][0] == 1 for i in pack.indices)
                if self._fits(pack, counts) and frames_ok:
                    toks, means, pooled = self._run_bucket(pack, pixel_values, grid, starts)
                else:
                    toks, means, pooled = self._run_eager(pack, pixel_values, grid_thw, starts)
                for j, i in enumerate(pack.indices):
                    out_tokens[i], out_means[i] = toks[j], means[j]
                    if pooled is not None:
                        out_pooled[i] = pooled[j]
                self.stats.images += len(pack.indices)
                self.stats.real_patches += pack.total
                self.stats.padded_patches += pack.padded if self._fits(pack, counts) and frames_ok else 0
        means = torch.stack(out_means) if out_means else torch.empty(0)
        pooled = torch.stack(out_pooled) if self.fixed is not None and out_pooled else None
        return RunOutput(out_tokens, means, pooled)

    def _run_bucket(self, pack: Pack, pixel_values, grid, starts):
        ws = self._workspace(pack.key)
        idx = pack.indices
        # consecutive images -> one contiguous slice of the packed input
        src = pixel_values[starts[idx[0]] : starts[idx[-1] + 1]]
        rows = src.shape[0]
        ws.pixel_values[:rows].copy_(src, non_blocking=True)
        # pinned: a pageable upload may wait for the replays already queued (GraphEncoder.encode_async)
        frames = torch.zeros(pack.key.max_images, 2, dtype=torch.long, pin_memory=self.device.type == "cuda")
        frames[: len(idx)] = torch.tensor([grid[i][1:] for i in idx])
        ws.frames_hw.copy_(frames, non_blocking=True)
        if self.use_graphs:
            if self.debug:
                assert ws.input_ptrs() == ws.captured_ptrs, f"bucket {pack.key}: inputs moved since capture"
            self.graphs[pack.key].replay()
        else:
            sub = [grid[i] for i in idx]
            self._body(ws, (max(h * w for _, h, w in sub), count_windows(sub, self.cfg)))
        self.stats.replays[pack.key.budget] += 1
        mu = self.cfg.merge_unit
        # copy out now: the next replay (of any bucket) may reuse the shared pool
        n_tok = rows // mu
        tokens = ws.tokens[:n_tok].clone()
        means = ws.means[: len(idx)].clone()
        pooled = ws.pooled[: len(idx)].clone() if ws.pooled is not None else None
        return list(torch.split(tokens, [self._tokens(grid[i]) for i in idx])), means, pooled

    def _tokens(self, thw) -> int:
        return thw[0] * thw[1] * thw[2] // self.cfg.merge_unit

    def _run_eager(self, pack: Pack, pixel_values, grid_thw, starts):
        idx = list(pack.indices)
        sub_grid = grid_thw[idx]
        g = sub_grid.tolist()
        src = torch.cat([pixel_values[starts[i] : starts[i + 1]] for i in idx]).to(self.device)
        if self.fixed is not None:
            tokens, pooled = self.tower(src, self.tower.eager_segments(len(idx), self.device))
            self.stats.eager_runs += 1
            means = tokens.view(len(idx), self.fixed, -1).float().mean(1)
            return list(torch.split(tokens, self.fixed)), means, pooled
        meta = compute_meta(
            frames_of(sub_grid).to(self.device),
            src.shape[0],
            self.cfg,
            max(h * w for _, h, w in g),
            count_windows(g, self.cfg),
        )
        tokens = self.tower(src, meta)
        parts = list(torch.split(tokens, [self._tokens(thw) for thw in g]))
        self.stats.eager_runs += 1
        return parts, torch.stack([p.float().mean(0) for p in parts]), None
