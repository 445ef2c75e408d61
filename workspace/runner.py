"""`GraphRunner`: packs images into buckets and runs each bucket as a captured CUDA graph.

Every bucket of the table is captured in the constructor, largest first, into one shared memory
pool. A batch is split into packs (`BucketTable.pack`); each pack is written into its bucket's
`Workspace` and replayed. A video is packed frame by frame (each temporal patch an image of its own, `run_all`),
so its frames share buckets with images and a long video spans several packs. Images no bucket takes (above the
largest budget or the per-image bound) run eagerly, each alone, through the same body, and so does a large pack
its bucket would pad much (`EXACT_MIN_PATCHES`), at its exact size. Without CUDA nothing is
captured and every pack runs that body eagerly, so CPU tests exercise packing, padding and geometry.

The runner knows no tower family: it talks to the tower only through `encoder.models.tower.GraphTower`
(static bounds per bucket, a capture geometry, the body, the outputs it writes). A fixed-resolution
tower (`patches_per_image` = L) needs buckets of whole images (budget n * L, max_images n), so
packing by patch count is packing by image count.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from encoder.models.geometry import frames_of
from encoder.models.tower import Bounds, GraphTower, TowerOutput
from workspace.buckets import BucketKey, BucketTable, Pack
from workspace.buffers import GraphShape, Workspace


class GraphCaptureError(RuntimeError):
    """The bucket graphs could not be captured (out of memory, unsupported op)."""


@dataclass
class RunOutput:
    """What one `run_all` returns, per image in input order."""

    tokens: list[torch.Tensor]  # [n_i, dim] each, device, model dtype (CLIP: float32)
    means: torch.Tensor  # [N, dim] float32
    pooled: torch.Tensor | None  # [N, out_dim] float32 model embeddings (CLIP / SigLIP), else None
    deepstack: list[list[torch.Tensor]] = field(default_factory=list)  # [image][layer] -> [n_i, out_dim]


@dataclass
class RunnerStats:
    captures: int = 0
    capture_seconds: float = 0.0
    capture_bytes: int = 0  # graph pool memory reserved by the captures
    workspace_bytes: int = 0
    replays: Counter = field(default_factory=Counter)  # budget -> replays
    eager_runs: int = 0  # packs run without a graph: images no bucket takes, and large packs at their exact size
    exact_runs: int = 0  # of those, packs a bucket would have taken with much padding (`GraphRunner._exact`)
    real_patches: int = 0
    padded_patches: int = 0
    images: int = 0  # items: images and videos
    videos: int = 0  # of those, videos (grid t > 1), packed frame by frame

    def as_dict(self) -> dict:
        return {
            "captures": self.captures,
            "capture_seconds": round(self.capture_seconds, 3),
            "capture_bytes": self.capture_bytes,
            "workspace_bytes": self.workspace_bytes,
            # read from other threads (the replica's stats) while the device thread counts: one C-level copy,
            # atomic under the GIL, then sorted; iterating the live Counter could meet a key added mid-way
            "replays": dict(sorted(dict.copy(self.replays).items())),
            "eager_runs": self.eager_runs,
            "exact_runs": self.exact_runs,
            "real_patches": self.real_patches,
            "padded_patches": self.padded_patches,
            "images": self.images,
            "videos": self.videos,
        }


# A pack of at least EXACT_MIN_PATCHES that would pad its bucket by at least EXACT_MIN_PADDING of the budget runs
# eagerly at its exact size: at that size the GPU work dwarfs the host's launches of an eager forward, and the
# padding rows are pure waste. Measured on the H100 (docs/journal/benchmarks.md): Qwen3-VL-8B 8 x 896² (25,088
# patches in the 32,768 bucket, 23% padding) 94.1 ms eager against 106.8 ms replayed. Below it the host decides:
# 32 x 14² (6,272 in 8,192) through `GraphEncoder.encode` took 25.97 ms eager against 18.42 ms replayed padded on a
# slow-launching host (its bare eager forward 16.16 ms; FA4), so mid-size packs replay padded.
EXACT_MIN_PATCHES = 16384
EXACT_MIN_PADDING = 0.125


class GraphRunner:
    def __init__(
        self,
        tower: GraphTower,
        table: BucketTable,
        max_image_patches: int,
        *,
        use_graphs: bool | None = None,
        debug: bool = False,
    ):
        if not isinstance(tower, GraphTower):
            raise TypeError(f"{type(tower).__name__} does not implement encoder.models.tower.GraphTower")
        self.tower = tower
        self.table = table
        self.device = next(tower.parameters()).device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.debug = debug
        self.max_image_patches = max_image_patches
        # packs this large and this padded run eagerly at their exact size (see EXACT_MIN_PATCHES); None: never
        self.exact_min_patches: int | None = EXACT_MIN_PATCHES
        self.exact_min_padding = EXACT_MIN_PADDING
        self.stats = RunnerStats()
        self.workspaces: dict[GraphShape, Workspace] = {}
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        # the graphs' memory pool (None until captured) and the lock that orders replays: the text graphs
        # (`workspace.text_runner`) capture into the same pool, so they take the same lock
        self.pool = None
        self.lock = threading.Lock()
        per_image = tower.patches_per_image
        for key in table.keys:
            if per_image is not None and key.budget != key.max_images * per_image:
                raise GraphCaptureError(
                    f"bucket {key} does not hold whole images of {per_image} patches; a fixed-resolution tower "
                    "needs buckets of n images x patches per image (workspace.graph_encoder.image_count_table)"
                )
            if key.budget % tower.merge_unit:
                raise GraphCaptureError(f"bucket budget {key.budget} is not a multiple of {tower.merge_unit}")
        self.shapes = {key: self._shapes_of(key) for key in table.keys}
        if self.use_graphs:
            self._capture_all()

    # -- the body every bucket runs (captured, or eager on CPU) --------------------------------
    def _body(self, ws: Workspace, bounds: Bounds | None = None) -> None:
        # `bounds` tightens the static ones when nothing is captured: same buffers and padding, but
        # attention sized to the batch (the CPU reference attention costs memory quadratic in them)
        out = self.tower.forward_packed(ws.pixel_values, ws.frames_hw, bounds or ws.bounds)
        if ws.out is None:
            ws.out = out
        else:
            ws.out.copy_(out)

    def _shapes_of(self, key: BucketKey) -> list[GraphShape]:
        """The graphs of one bucket, cheapest launch first: the full shape (every slot, the longest image
        the bucket can hold), then, for variable-resolution towers, shapes whose longest image is a
        half, a quarter, ... of it, each with slots for exactly as many such images as fill the budget
        (8 x 896² in a 25,088-patch bucket: no empty attention tile) and for twice as many (mixed sizes)."""
        longest = min(self.max_image_patches, key.budget)
        shapes = {GraphShape(key.budget, key.max_images, self.tower.bucket_bounds(key.budget, key.max_images, longest))}
        while self.tower.patches_per_image is None and longest > 64:
            longest = -(-longest // 2)
            fill = -(-key.budget // longest)  # images of `longest` patches that fill the budget
            if fill > key.max_images:
                break
            for slots in {fill, min(key.max_images, 2 * fill)}:
                shapes.add(GraphShape(key.budget, slots, self.tower.bucket_bounds(key.budget, slots, longest)))
        return sorted(shapes, key=lambda g: (g.launch_cost, g.max_images))

    def _workspace(self, shape: GraphShape) -> Workspace:
        ws = self.workspaces.get(shape)
        if ws is None:
            # normal tensors even when first needed under inference_mode: tests and debug tools
            # may write into them later
            with torch.inference_mode(False):
                ws = Workspace.allocate(shape, self.tower.patch_dim, self.device)
            self.workspaces[shape] = ws
        return ws

    def _fill_dummy(self, ws: Workspace) -> None:
        # a valid geometry for warm-up and capture, random patches
        ws.pixel_values.normal_()
        ws.frames_hw.copy_(self.tower.dummy_frames(ws.key.budget, ws.key.max_images, ws.bounds))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.pool = pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved(self.device)
        ws_bytes = 0
        every = [shape for shapes in self.shapes.values() for shape in shapes]
        for key in sorted(every, key=lambda g: (g.budget, g.launch_cost), reverse=True):
            ws = self._workspace(key)
            ws_bytes += ws.pixel_values.nbytes + ws.frames_hw.nbytes
            self._fill_dummy(ws)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body(ws)  # warm-up: kernel JIT, cuBLAS workspaces, first allocations
                ws.out = None
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
    def _exact(self, pack: Pack) -> Pack:
        """`pack` as an eager pack of its exact size when it is large and its bucket would pad it much."""
        if pack.key is None or self.exact_min_patches is None or pack.total < self.exact_min_patches:
            return pack
        if pack.padded < self.exact_min_padding * pack.key.budget:
            return pack
        self.stats.exact_runs += 1
        return Pack(None, pack.indices, pack.total)

    def _packs(self, counts: list[int], grid: list[list[int]]) -> list[Pack]:
        """The table's packs, where an image no graph takes (above the per-image bound) leaves its pack for an
        eager pack of its own; the images on either side of it keep their bucket. A large pack its bucket would
        pad much runs eagerly at its exact size (`_exact`)."""
        return [self._exact(pack) for pack in self._bucket_packs(counts, grid)]

    def _bucket_packs(self, counts: list[int], grid: list[list[int]]) -> list[Pack]:
        packs: list[Pack] = []
        for pack in self.table.pack(counts):
            alone = [i for i in pack.indices if counts[i] > self.max_image_patches]
            if pack.key is None or not alone:
                packs.append(pack)
                continue
            run: list[int] = []
            for i in (*pack.indices, None):
                if i is not None and i not in alone:
                    run.append(i)
                    continue
                if run:  # part of a pack that fit: fits a bucket
                    total = sum(counts[j] for j in run)
                    packs.append(Pack(self.table.bucket_for(total, len(run)), tuple(run), total))
                    run = []
                if i is not None:
                    packs.append(Pack(None, (i,), counts[i]))
        return packs

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Tokens per image ([n_i, out_dim] each, device, model dtype) and means [N, out_dim] float32."""
        out = self.run_all(pixel_values, grid_thw)
        return out.tokens, out.means

    @torch.inference_mode()  # as GraphEncoder's callers: no autograd bookkeeping on the eager packs' launches
    def run_all(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> RunOutput:
        """Tokens and means per image, plus the model embeddings and DeepStack features where the tower has them.

        A video (grid t > 1) is packed as its t temporal patches, each a frame of (1, h, w): the towers attend
        within a frame and place it by its own (h, w) only, so a video's tokens are its frames' tokens in order,
        whichever packs the frames land in. A video larger than a bucket is split at those (frame-pair)
        boundaries; its mean is that of all its tokens."""
        items = grid_thw.tolist()
        grid = [[1, h, w] for t, h, w in items for _ in range(t)]  # one row per frame (temporal patch)
        counts = [h * w for _, h, w in grid]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        n = len(counts)
        out_tokens: list[torch.Tensor | None] = [None] * n
        out_means: list[torch.Tensor | None] = [None] * n
        out_pooled: list[torch.Tensor | None] = [None] * n
        out_deep: list[list[torch.Tensor]] = [[] for _ in range(n)]
        with self.lock:
            for pack in self._packs(counts, grid):
                in_bucket = pack.key is not None
                run = self._run_bucket if in_bucket else self._run_eager
                toks, means, pooled, deep = run(pack, pixel_values, grid, starts)
                for j, i in enumerate(pack.indices):
                    out_tokens[i], out_means[i] = toks[j], means[j]
                    out_deep[i] = [d[j] for d in deep]
                    if pooled is not None:
                        out_pooled[i] = pooled[j]
                self.stats.real_patches += pack.total
                self.stats.padded_patches += pack.padded if in_bucket else 0
            self.stats.images += len(items)
            self.stats.videos += sum(t > 1 for t, _, _ in items)
        if len(items) != n:  # videos: their frames' outputs joined back
            out_tokens, out_means, out_pooled, out_deep = self._join_frames(items, out_tokens, out_means, out_pooled,
                                                                            out_deep)  # fmt: skip
        means = torch.stack(out_means) if out_means else torch.empty(0)
        pooled = torch.stack(out_pooled) if out_pooled and out_pooled[0] is not None else None
        return RunOutput(out_tokens, means, pooled, out_deep)

    @staticmethod
    def _join_frames(items, tokens, means, pooled, deep):
        """Per-frame outputs -> per-item outputs: a video's tokens (and DeepStack features) concatenated in frame
        order, its mean over all of them (as the eager encoder takes it); images as they are."""
        j_tokens, j_means, j_pooled, j_deep = [], [], [], []
        f = 0
        for t, _, _ in items:
            if t == 1:
                j_tokens.append(tokens[f])
                j_means.append(means[f])
                j_pooled.append(pooled[f])
                j_deep.append(deep[f])
            else:
                assert pooled[f] is None, "towers with their own embedding take still images only"
                joined = torch.cat(tokens[f : f + t])
                j_tokens.append(joined)
                j_means.append(joined.float().mean(0))
                j_pooled.append(None)
                j_deep.append([torch.cat([deep[k][layer] for k in range(f, f + t)]) for layer in range(len(deep[f]))])
            f += t
        return j_tokens, j_means, j_pooled, j_deep

    def _split(self, out: TowerOutput, rows: int, sizes: list[int], copy: bool = True):
        # bucket outputs are copied out now: the next replay (of any bucket) may reuse the shared pool;
        # an eager run's outputs are its own (copy=False)
        n_tok = rows // self.tower.merge_unit
        take = (lambda t: t[:n_tok].clone()) if copy else (lambda t: t[:n_tok])
        return list(torch.split(take(out.tokens), sizes)), [list(torch.split(take(d), sizes)) for d in out.deepstack]

    def _run_bucket(self, pack: Pack, pixel_values, grid, starts):
        idx = pack.indices
        longest = max(grid[i][1] * grid[i][2] for i in idx)
        shape = next(g for g in self.shapes[pack.key] if g.holds(len(idx), longest))  # the full shape holds all
        ws = self._workspace(shape)
        # consecutive images -> one contiguous slice of the packed input
        src = pixel_values[starts[idx[0]] : starts[idx[-1] + 1]]
        rows = src.shape[0]
        ws.pixel_values[:rows].copy_(src, non_blocking=True)
        # padding rows are zeros, not the last pack's pixels: deterministic, and finite whatever was there
        ws.pixel_values[rows:].zero_()
        # pinned: a pageable upload may wait for the replays already queued (GraphEncoder.encode_async)
        frames = torch.zeros(shape.max_images, 2, dtype=torch.long, pin_memory=self.device.type == "cuda")
        frames[: len(idx)] = torch.tensor([grid[i][1:] for i in idx])
        ws.frames_hw.copy_(frames, non_blocking=True)
        if self.use_graphs:
            if self.debug:
                assert ws.input_ptrs() == ws.captured_ptrs, f"graph {shape}: inputs moved since capture"
            self.graphs[shape].replay()
        else:
            self._body(ws, self.tower.batch_bounds([grid[i] for i in idx]))
        self.stats.replays[pack.key.budget] += 1
        tokens, deep = self._split(ws.out, rows, [self._tokens(grid[i]) for i in idx])
        means = ws.out.means[: len(idx)].clone()
        pooled = ws.out.pooled[: len(idx)].clone() if ws.out.pooled is not None else None
        return tokens, means, pooled, deep

    def _tokens(self, thw) -> int:
        return thw[0] * thw[1] * thw[2] // self.tower.merge_unit

    def _run_eager(self, pack: Pack, pixel_values, grid, starts):
        # what no bucket fits: the same body over exactly these images (one frame slot per frame)
        idx = list(pack.indices)
        sub = [grid[i] for i in idx]
        # packs hold consecutive images (`BucketTable.pack`): one slice of the packed input, as in _run_bucket
        src = pixel_values[starts[idx[0]] : starts[idx[-1] + 1]].to(self.device)
        # pinned and non-blocking, as in _run_bucket: a pageable upload would wait for every replay already
        # queued, so the host could not launch this forward while the GPU runs the previous batch
        frames = frames_of(torch.tensor(sub))
        if self.device.type == "cuda":
            frames = frames.pin_memory().to(self.device, non_blocking=True)
        out = self.tower.forward_packed(src, frames, self.tower.batch_bounds(sub))
        self.stats.eager_runs += 1
        tokens, deep = self._split(out, src.shape[0], [self._tokens(thw) for thw in sub], copy=False)
        means = [p.float().mean(0) for p in tokens]  # per image (an image may span several frames)
        return tokens, means, out.pooled, deep
