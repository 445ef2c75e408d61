"""The protocol between a vision tower and the graph runner (`workspace.GraphRunner`).

The runner knows nothing about families. Every tower (Qwen2-VL / 2.5-VL, Qwen3-VL / 3.5, CLIP,
SigLIP, the next one) answers the same questions:

  * what one packed patch row is (`patch_dim`) and how many patches make one output token
    (`merge_unit`); for fixed-resolution towers, how many patches every image has
    (`patches_per_image`; None for variable-resolution towers);
  * the static sizes baked into a bucket's graph (`bucket_bounds(key, max_image_patches)`), and the
    tight ones of one concrete batch (`batch_bounds(grid)`) for eager runs;
  * a valid geometry to warm up and capture with (`dummy_frames(key, bounds)`);
  * the body (`forward_packed(pixel_values, frames_hw, bounds)`): one fixed sequence of tensor ops,
    no host reads of image data, so it is captured into a graph on CUDA and run as-is on the CPU
    and for batches no bucket fits;
  * the outputs it writes (`TowerOutput`: tokens, per-slot means, the model's own pooled embedding
    where it has one, DeepStack features where it has them).

The static buffers a bucket needs are the same for every tower today: packed patches
`[budget, patch_dim]` and the per-frame grid `[max_images, 2]` (rows of (h, w) in patches; zero rows
are empty slots). Everything else (segments, rotary tables, window permutation, position
interpolation weights) is computed by the body from those two, inside the graph.

`FixedResolutionTower` answers the protocol for every tower whose images are all one size (CLIP, SigLIP,
DINOv2, DINOv3) from its config; `FullAttentionTower` is what those and SigLIP2 share about their blocks.

Text towers answer `TextGraphTower` for `workspace.text_runner`: their static buffers are token ids and mask
[texts, columns], and they say which leading columns each text's output depends on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from encoder.attention import AttentionBackend
from encoder.kernels.elementwise import segment_means  # noqa: F401  (the towers' and tests' name for it)


@dataclass(frozen=True)
class Bounds:
    """Static sizes of one graph: the longest segment and the number of window segments."""

    max_seqlen: int  # upper bound on one frame's tokens inside the blocks
    window_slots: int = 0  # static count of window-attention segments (extra ones are empty)


@dataclass
class TowerOutput:
    """What a tower's body writes for `max_images` frame slots (padding slots and rows included)."""

    tokens: torch.Tensor  # [rows / merge_unit, token_dim] output tokens, model dtype (or float32)
    means: torch.Tensor  # [slots, token_dim] float32 mean of each slot's tokens (0 for empty slots)
    pooled: torch.Tensor | None = None  # [slots, out_dim] float32 model embedding (CLIP / SigLIP)
    deepstack: list[torch.Tensor] = field(default_factory=list)  # each [rows / merge_unit, out_dim]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.tokens, self.means, self.pooled, *self.deepstack) if t is not None]

    def copy_(self, other: TowerOutput) -> None:
        """Write `other` into these (static) tensors: how a captured body keeps its output addresses."""
        for dst, src in zip(self.tensors(), other.tensors(), strict=True):
            dst.copy_(src)


@runtime_checkable
class GraphTower(Protocol):
    """What `workspace.GraphRunner` needs from a tower (see the module docstring)."""

    patch_dim: int
    merge_unit: int
    patches_per_image: int | None

    def bucket_bounds(self, budget: int, max_images: int, max_image_patches: int) -> Bounds: ...

    def batch_bounds(self, grid: list[list[int]]) -> Bounds: ...

    def dummy_frames(self, budget: int, max_images: int, bounds: Bounds) -> torch.Tensor: ...

    def forward_packed(self, pixel_values: torch.Tensor, frames_hw: torch.Tensor, bounds: Bounds) -> TowerOutput: ...


@runtime_checkable
class TextGraphTower(Protocol):
    """What `workspace.text_runner.TextGraphRunner` needs from a text tower (CLIP, SigLIP, the next one).

    A batch is [B, seq_len] token ids and their attention mask (int64, the tokenizer's fixed length), and the
    forward is one fixed sequence of tensor ops with no host reads: captured per (batch, columns) on CUDA.
    `prefix_exact`: each text's output depends only on its first `output_spans` columns, so the columns after
    the batch's longest span can be dropped and a graph of fewer columns gives the same output (a causal tower
    pooled at its EOS, with right padding); False: every column counts (pads attended to, left padding, a
    pooled last position), and the graphs keep all `seq_len` columns.
    """

    seq_len: int
    out_dim: int
    prefix_exact: bool

    def output_spans(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


def frames_dummy(budget: int, max_images: int, bounds: Bounds, merge: int) -> torch.Tensor:
    """A valid variable-resolution geometry for warm-up and capture: one image spanning the budget
    (merge x budget/merge patches) or, when the bounds cap one image's size, as many bound-size
    images as fit; the other slots empty."""
    frames = torch.zeros(max_images, 2, dtype=torch.long)
    rows = max(1, min(max_images, -(-budget // bounds.max_seqlen)))
    per = budget // rows // (merge * merge) * (merge * merge)
    for i in range(rows):
        frames[i] = torch.tensor([merge, per // merge])
    return frames


def backends_per_kind(backend: AttentionBackend | Mapping[str, AttentionBackend] | None, kinds: tuple[str, ...]):
    """kind -> backend for a tower's layer kinds ("full", and "window" for windowed towers): one
    backend for every kind (None: set later), or a mapping that names each."""
    if backend is None or isinstance(backend, AttentionBackend):
        return dict.fromkeys(kinds, backend)
    missing = [k for k in kinds if k not in backend]
    assert not missing, f"no attention backend for layer kinds {missing}"
    return {k: backend[k] for k in kinds}


class FullAttentionTower:
    """Mixed in before `nn.Module` by a tower whose blocks (`blocks`) all attend over whole images (one layer
    kind, "full") through a `layers.PackedAttention` child named `attention_name`, and hold an `mlp` with
    `fused(multiple)`."""

    attention_kinds = ("full",)
    attention_name = "attention"

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def set_backend(self, backend: AttentionBackend | Mapping[str, AttentionBackend]) -> None:
        self.backends = backends_per_kind(backend, self.attention_kinds)
        self.backend = self.backends["full"]
        for block in self.blocks:
            getattr(block, self.attention_name).backend = self.backend

    def transformer_blocks(self) -> nn.ModuleList:
        """The blocks whose linear layers `quantization="fp8"` converts (`encoder.models.fp8`)."""
        return self.blocks

    def fuse(self, pad_mlp: int = 128) -> None:
        """Inference-only layout changes, all exact, as new modules: the MLPs' hidden width zero-padded to a
        multiple of `pad_mlp` where the MLP pads (SigLIP's 4304 -> 4352), q/k/v in one GEMM. Idempotent."""
        for block in self.blocks:
            block.mlp = block.mlp.fused(pad_mlp)
            setattr(block, self.attention_name, getattr(block, self.attention_name).fused())


class FixedResolutionTower(FullAttentionTower):
    """The graph protocol of a tower over fixed-resolution images, from its `cfg` (`patch_dim`, `num_patches`,
    `seq_len`, `grid`): every image is L = num_patches patches and one attention segment of T = seq_len
    tokens inside the blocks, so a bucket is n whole images (budget n * L). The tower's
    `forward(pixel_values, cu_seqlens)` gives (tokens [n * L, D], pooled [n, out_dim])."""

    merge_unit = 1  # one output token per patch

    @property
    def patch_dim(self) -> int:
        return self.cfg.patch_dim

    @property
    def patches_per_image(self) -> int:
        return self.cfg.num_patches

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    def bucket_bounds(self, budget: int, max_images: int, max_image_patches: int) -> Bounds:
        return Bounds(self.seq_len)

    def batch_bounds(self, grid: list[list[int]]) -> Bounds:
        return Bounds(self.seq_len)

    def dummy_frames(self, budget: int, max_images: int, bounds: Bounds) -> torch.Tensor:
        return torch.tensor([self.cfg.grid, self.cfg.grid]).repeat(max_images, 1)  # every slot real

    def segments(self, frames_hw: torch.Tensor) -> torch.Tensor:
        """cu_seqlens [N + 1] int32 for N image slots; slots with a zero (h, w) row are empty segments.

        Real images come first, so the boundaries are 0, T, 2T, ..., kT, kT, ...: computed on the
        device from data, so a captured graph stays right for any image count.
        """
        real = (frames_hw[:, 0] * frames_hw[:, 1] > 0).to(torch.int32)
        return F.pad(torch.cumsum(real * self.seq_len, 0), (1, 0)).to(torch.int32)

    def forward_packed(self, pixel_values: torch.Tensor, frames_hw: torch.Tensor, bounds: Bounds) -> TowerOutput:
        # pixel_values: [n * L, C*P*P] for n = frames_hw.shape[0] slots; padding slots are whole
        # images of stale rows in empty segments, never mixed with real ones
        tokens, pooled = self(pixel_values, self.segments(frames_hw))  # [n * L, D], [n, out_dim]
        means = tokens.view(frames_hw.shape[0], self.cfg.num_patches, -1).float().mean(1)
        return TowerOutput(tokens, means, pooled)

    def check_input(self, pixel_values: torch.Tensor) -> None:
        cfg = self.cfg
        assert pixel_values.dim() == 2 and pixel_values.shape[1] == cfg.patch_dim, pixel_values.shape
        assert pixel_values.shape[0] % cfg.num_patches == 0, (pixel_values.shape, cfg.num_patches)

    def run_blocks(self, x: torch.Tensor, cu_seqlens: torch.Tensor, *position: torch.Tensor) -> torch.Tensor:
        """The blocks over the float32 residual stream [n * T, D] -> its float32 sum after the last block;
        `position`: what the blocks take besides (DINOv3's rotary tables)."""
        delta = None
        for block in self.blocks:
            x, delta = block(x, delta, cu_seqlens, self.seq_len, *position)
        return x + delta
