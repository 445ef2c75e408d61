"""`TextGraphRunner`: the text tower captured per (texts, columns) key and replayed, like the image buckets.

Every key of the table (`workspace.text_buckets`) is captured in the constructor, largest first, into the
memory pool of the image graphs when one is given (`GraphRunner.pool`; then replays take the image runner's
lock too: graphs of one pool must not run interleaved). A batch is split into chunks of at most the largest
batch; each chunk's ids and mask are written into its key's static buffers (the first `seq` columns; rows past
the chunk's texts repeat its first text, a valid input, so no padding row can produce NaN) and the graph
replayed; its outputs are copied out at once (the pool's next replay may reuse them). Without CUDA, or with
`use_graphs=False`, nothing is captured and each chunk runs the tower eagerly on the same buffers, so CPU tests
exercise the same chunking, trimming and padding.

The runner knows the tower only through `encoder.models.tower.TextGraphTower`: which columns matter per text
(`output_spans`), whether fewer columns are exact (`prefix_exact`), and the forward.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from encoder.models.tower import TextGraphTower
from workspace.runner import GraphCaptureError
from workspace.text_buckets import TextChunk, TextKey, TextTable


@dataclass
class TextWorkspace:
    """The static buffers of one text graph, at fixed addresses for its life."""

    key: TextKey
    tokens: torch.Tensor  # [2, batch, seq] int64: token ids, then the attention mask (one upload for both)
    out: torch.Tensor | None = None  # [batch, out_dim] float32, written by the graph (or the eager forward)
    captured_ptr: int = 0

    @classmethod
    def allocate(cls, key: TextKey, device) -> TextWorkspace:
        return cls(key, torch.zeros(2, key.batch, key.seq, dtype=torch.int64, device=device))

    @property
    def ids(self) -> torch.Tensor:
        return self.tokens[0]

    @property
    def mask(self) -> torch.Tensor:
        return self.tokens[1]


@dataclass
class TextRunnerStats:
    captures: int = 0
    capture_seconds: float = 0.0
    capture_bytes: int = 0  # pool memory the text captures added
    replays: Counter = field(default_factory=Counter)  # "BxS" key -> replays (eager runs of a key on the CPU)
    eager_runs: int = 0  # chunks no key holds (a span past every column count)
    texts: int = 0
    tokens: int = 0  # real tokens (mask ones) of the texts
    token_slots: int = 0  # token positions the replays ran (batch x columns of each key used): padding included

    def as_dict(self) -> dict:
        return {
            "captures": self.captures,
            "capture_seconds": round(self.capture_seconds, 3),
            "capture_bytes": self.capture_bytes,
            # copied first: another thread (the replica's stats) may read while the device thread counts
            "replays": dict(sorted(dict.copy(self.replays).items())),
            "eager_runs": self.eager_runs,
            "texts": self.texts,
            "tokens": self.tokens,
            "token_slots": self.token_slots,
        }


class TextGraphRunner:
    def __init__(
        self,
        tower: TextGraphTower,
        table: TextTable,
        *,
        use_graphs: bool | None = None,
        pool=None,
        lock: threading.Lock | None = None,
        debug: bool = False,
    ):
        if not isinstance(tower, TextGraphTower):
            raise TypeError(f"{type(tower).__name__} does not implement encoder.models.tower.TextGraphTower")
        if table.seqs[-1] > tower.seq_len or (not tower.prefix_exact and table.seqs != (tower.seq_len,)):
            raise GraphCaptureError(
                f"text graph columns {list(table.seqs)} do not suit a tower of {tower.seq_len} columns "
                f"(prefix-exact: {tower.prefix_exact}); build the table with workspace.text_buckets.text_table"
            )
        self.tower, self.table, self.debug = tower, table, debug
        self.device = next(tower.parameters()).device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.pool, self.lock = pool, lock or threading.Lock()
        self.stats = TextRunnerStats()
        self.workspaces: dict[TextKey, TextWorkspace] = {}
        self.graphs: dict[TextKey, torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            with self.lock:
                self._capture_all()

    def _workspace(self, key: TextKey) -> TextWorkspace:
        ws = self.workspaces.get(key)
        if ws is None:
            with torch.inference_mode(False):  # normal tensors: tests and debug tools may write into them
                ws = TextWorkspace.allocate(key, self.device)
            self.workspaces[key] = ws
        return ws

    def _body(self, ws: TextWorkspace) -> None:
        out = self.tower.forward(ws.ids, ws.mask)  # [batch, out_dim] float32
        if ws.out is None:
            ws.out = out
        else:
            ws.out.copy_(out)

    @staticmethod
    def _fill_dummy(ws: TextWorkspace) -> None:
        # valid texts to warm up and capture with (id 0 is in every vocabulary; every position a token): the
        # forward reads no data on the host, so the captured kernels do not depend on these values
        ws.ids.zero_()
        ws.mask.fill_(1)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved(self.device)
        for key in sorted(self.table.keys, reverse=True):  # largest first: later graphs reuse its blocks
            ws = self._workspace(key)
            self._fill_dummy(ws)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body(ws)  # warm-up: cuBLAS workspaces, first allocations
                ws.out = None
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self._body(ws)
            except torch.OutOfMemoryError as exc:
                raise GraphCaptureError(
                    f"out of GPU memory capturing text graph {key}; use fewer text buckets or skip text graphs"
                ) from exc
            ws.captured_ptr = ws.tokens.data_ptr()
            self.graphs[key] = graph
            self.stats.captures += 1
        torch.cuda.synchronize()
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.capture_bytes = torch.cuda.memory_reserved(self.device) - before

    # -- running a batch ---------------------------------------------------------------------
    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, out_dim] float32 on the tower's device, the tower's outputs for `ids` and `mask` ([B, seq_len]
        int64, checked by the caller: `encoder.text_encoder.TextEncoder.check_ids`)."""
        if ids.shape[0] == 0:
            return torch.empty(0, self.tower.out_dim, device=self.device)
        spans = self.tower.output_spans(ids, mask).tolist()  # [B]: columns each output depends on
        with self.lock:
            outs = [self._run_chunk(c, ids, mask) for c in self.table.chunks(spans)]
        self.stats.texts += ids.shape[0]
        self.stats.tokens += int(mask.sum())
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _run_chunk(self, chunk: TextChunk, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a, b = chunk.start, chunk.stop
        if chunk.key is None:  # a span no graph's columns hold: the tower at the full length
            self.stats.eager_runs += 1
            return self.tower.forward(ids[a:b].to(self.device), mask[a:b].to(self.device)).float()
        key = chunk.key
        ws = self._workspace(key)
        # [2, batch, seq]: the chunk's ids and mask, trimmed to the key's columns; rows past its texts repeat
        # its first (pinned on the host: an upload from pageable memory would wait for queued replays)
        pinned = ids.device.type == "cpu" and self.device.type == "cuda"
        host = torch.empty(2, key.batch, key.seq, dtype=torch.int64, device=ids.device, pin_memory=pinned)
        host[0, : chunk.size] = ids[a:b, : key.seq]
        host[1, : chunk.size] = mask[a:b, : key.seq]
        host[:, chunk.size :] = host[:, :1]
        ws.tokens.copy_(host, non_blocking=True)
        if self.use_graphs:
            if self.debug:
                assert ws.tokens.data_ptr() == ws.captured_ptr, f"text graph {key}: inputs moved since capture"
            self.graphs[key].replay()
        else:
            self._body(ws)
        self.stats.replays[str(key)] += 1
        self.stats.token_slots += key.batch * key.seq
        # copied out now: the next replay of any graph in the pool may reuse the output's memory
        return ws.out[: chunk.size].clone()
