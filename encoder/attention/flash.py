"""Varlen attention on the flash-attn packages: FA2 (`flash_attn`), FA3 (`flash_attn_interface`) and
FA4 (`flash_attn.cute`, the `flash-attn-4` wheels).

All take packed [S, H, D] tensors with `cu_seqlens_q/k` and `max_seqlen_q/k`, exactly our layout,
and are fp16/bf16 only. None is a hard dependency: each backend reports why it is unavailable when
its import fails. The packages are imported lazily (first `unavailable_reason` or call), so
importing this module never pays for, or fails on, a CUDA extension load.

Output: when the installed function accepts `out=`, we pass ours and the kernel writes only rows
inside segments; otherwise its result's real rows, selected on the device, are copied into `out`.
Either way the padding rows past `cu_seqlens[-1]` are then zeroed (`kernels.zero_rows_past`): FA4
reads keys and values past a segment's end, so garbage there (an `empty_like`'s NaN bit patterns)
would reach the last image through the next layer.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import torch

from encoder.attention.base import AttentionBackend
from encoder.attention.torch_varlen import _keep_real_rows
from encoder.kernels.elementwise import zero_rows_past

_DTYPES = (torch.float16, torch.bfloat16)


def _version(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"  # (9, 0) -> "9.0", as NVIDIA writes it


class _FlashVarlenBase(AttentionBackend):
    _module: str = ""  # package exposing flash_attn_varlen_func
    _min_capability: tuple[int, int] = (8, 0)
    # per class: (function, accepts out=) or the import error text; filled on first use
    _loaded: tuple | str | None = None

    @classmethod
    def _load(cls) -> tuple | str:
        if cls._loaded is None:
            try:
                fn = importlib.import_module(cls._module).flash_attn_varlen_func
            except Exception as exc:  # noqa: BLE001 - any failure of an optional package makes it unavailable
                # OSError: the extension's shared library fails to load (CUDA / torch ABI mismatch); a RuntimeError
                # or a version check at import would otherwise fail every `available_backends()`, `auto` on CPU too
                cls._loaded = f"{cls._module} is not importable ({type(exc).__name__}: {exc})"
            else:
                try:
                    takes_out = "out" in inspect.signature(fn).parameters
                except (TypeError, ValueError):  # builtins without a signature
                    takes_out = False
                cls._loaded = (fn, takes_out)
        return cls._loaded

    @classmethod
    def unavailable_reason(cls) -> str | None:
        loaded = cls._load()
        if isinstance(loaded, str):
            return loaded
        if not torch.cuda.is_available():
            return f"{cls._module} needs a CUDA device"
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        if caps and max(caps) < cls._min_capability:
            need, have = _version(cls._min_capability), ", ".join(_version(c) for c in sorted(caps))
            return f"{cls.name} needs a GPU of compute capability >= {need}; the GPUs here have {have}"
        return None

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"{self.name} runs only on CUDA"
        if dtype not in _DTYPES:
            return f"{self.name} supports fp16/bf16 only, not {dtype}"
        if head_dim > 256 or head_dim % 8:
            return f"{self.name} needs head_dim a multiple of 8 and <= 256, got {head_dim}"
        cap = torch.cuda.get_device_capability(device)
        if cap < self._min_capability:
            need, have = _version(self._min_capability), _version(cap)
            return f"{self.name} needs compute capability >= {need}, device has {have}"
        return None

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        fn, takes_out = self._load()
        # the kernels require unit stride on the head dim
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        if takes_out and out.is_contiguous():
            fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, out=out)
            return zero_rows_past(out, cu_seqlens)
        result = fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
        if isinstance(result, tuple):  # some FA3 releases return (out, softmax_lse)
            result = result[0]
        return zero_rows_past(_keep_real_rows(out, result, cu_seqlens), cu_seqlens)


class FlashAttn2(_FlashVarlenBase):
    name = "flash_attn"
    _module = "flash_attn"
    _loaded = None


class FlashAttn3(_FlashVarlenBase):
    name = "fa3"
    _module = "flash_attn_interface"
    _min_capability = (9, 0)  # FA3 kernels are Hopper-only (wgmma / TMA)
    _loaded = None


# FA4's persistent cache of compiled kernels (its own variables): on unless the user set them, in the user's cache
# directory, so a restart skips the ~3 s per kernel configuration of the first start (docs/performance.md#start-up)
FA4_CACHE_ENABLED, FA4_CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def fa4_cache_dir() -> Path:
    """Where FA4 keeps compiled kernels unless told otherwise: $XDG_CACHE_HOME (or ~/.cache)/vision-encoder/fa4."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vision-encoder" / "fa4"


def use_fa4_cache() -> None:
    """Turn FA4's compiled-kernel cache on before flash_attn.cute is imported (it reads its variables then); a
    value the user set wins (`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0` turns it off)."""
    os.environ.setdefault(FA4_CACHE_ENABLED, "1")
    os.environ.setdefault(FA4_CACHE_DIR, str(fa4_cache_dir()))


class FlashAttn4(_FlashVarlenBase):
    """FlashAttention-4 (`flash-attn-4`, CuTe DSL; Hopper and Blackwell). Kernels compile at first use
    (~3 s per configuration: the warm-up before capture pays it). Its public `flash_attn_varlen_func`
    takes `qv` as the fourth positional argument and returns a fresh tensor, so we call it by keyword;
    the forward it wraps (`interface._flash_attn_fwd`, private) accepts `out=` and is used when present
    (checked by signature), which skips the copy of real rows."""

    name = "fa4"
    _module = "flash_attn.cute"
    _min_capability = (9, 0)
    _loaded = None

    @classmethod
    def _load(cls) -> tuple | str:
        if cls._loaded is None:
            use_fa4_cache()
            try:
                interface = importlib.import_module("flash_attn.cute.interface")
                varlen = interface.flash_attn_varlen_func
            except Exception as exc:  # noqa: BLE001 - as in _FlashVarlenBase._load
                cls._loaded = f"flash_attn.cute (flash-attn-4) is not importable ({type(exc).__name__}: {exc})"
                return cls._loaded
            fwd = getattr(interface, "_flash_attn_fwd", None)
            try:
                takes_out = fwd is not None and "out" in inspect.signature(fwd).parameters
            except (TypeError, ValueError):
                takes_out = False
            cls._loaded = (fwd if takes_out else varlen, takes_out)
        return cls._loaded

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        fn, takes_out = self._load()
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        kwargs = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)
        kwargs.update(max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
        if takes_out and out.is_contiguous():
            fn(q, k, v, out=out, **kwargs)  # writes rows inside segments only
            return zero_rows_past(out, cu_seqlens)
        result = fn(q, k, v, **kwargs)
        if isinstance(result, tuple):  # (out, lse)
            result = result[0]
        return zero_rows_past(_keep_real_rows(out, result, cu_seqlens), cu_seqlens)
