"""The one switch between the Triton kernels and their torch references (timm's fused/reference pattern).

`fused(x)` decides per tensor: Triton on CUDA, the torch reference elsewhere (the CPU, an install
without triton, or `ENCODER_FUSED=0` to compare the two on a GPU).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # CPU-only installs without triton use the references
    triton = None


def fused(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and os.environ.get("ENCODER_FUSED", "1") != "0"
