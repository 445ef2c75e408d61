"""`LLMOutput`: what an LLM server needs from the vision tower for one image or video.

A VLM serving stack that runs the encoder as its own service replaces its vision tower with these:
`tokens` go into the image placeholder positions of the prompt, `deepstack` (Qwen3-VL) is added to
the hidden states of the LLM's first decoder layers at those positions, and `grid_thw` is what the
LLM's M-RoPE positions are computed from (with, for a Qwen2.5-VL video, `second_per_grid_ts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LLMOutput:
    """One image's LLM-ready outputs (float32 CPU tensors)."""

    tokens: torch.Tensor  # [n, out_dim] merger output, == encode(..., pooling="none")
    grid_thw: tuple[int, int, int]  # the patch grid, == the HF processor's image_grid_thw row
    deepstack: list[torch.Tensor] = field(default_factory=list)  # one [n, out_dim] per DeepStack layer, model order
    # a Qwen3-VL video's seconds per temporal patch (its prompt's `<t seconds>`), else None
    timestamps: list[float] | None = None
    # a Qwen2/2.5-VL video's seconds one temporal patch spans (Qwen2.5-VL's `second_per_grid_ts`: the temporal
    # M-RoPE positions step by tokens_per_second x this), else None
    second_per_grid_ts: float | None = None

    def vllm_embeds(self) -> torch.Tensor:
        """The one tensor vLLM's Qwen models produce for this image (and take as `image_embeds`):
        `[n, out_dim * (1 + len(deepstack))]`, the tokens then each DeepStack layer on the last dimension, in
        model order; the tokens themselves for towers without DeepStack (docs/llm-handoff.md "vLLM")."""
        return torch.cat([self.tokens, *self.deepstack], dim=1) if self.deepstack else self.tokens

    def __post_init__(self):
        assert len(self.grid_thw) == 3, self.grid_thw
        assert all(d.shape == self.tokens.shape for d in self.deepstack), "deepstack features must match tokens"
