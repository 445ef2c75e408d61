"""LLM-ready outputs between the encoder replica, the ingress and the client (README "Feeding an LLM server").

Per image the encoder replica's `encode_llm_pixels` returns a `WireLLM` tuple `(tokens, deepstack, grid_thw)`:
`tokens` `[n, out_dim]` and each DeepStack layer's `[n, out_dim]` (`[]` for towers without) as numpy arrays
in the requested wire dtype, and the patch grid `(t, h, w)`. The engine casts on the device before its one
copy to host memory (`GraphEncoder.encode_llm_async(..., dtype)`), so the results thread only makes numpy
views; a bfloat16 answer crosses the process boundary at half the bytes of float32 and the ingress only
base64-encodes the buffers. A video's tuple gets its facts appended by the ingress, which decoded it
(`VIDEO_FACTS`, `video_facts`): `(tokens, deepstack, grid_thw, timestamps, second_per_grid_ts)`.

Wire dtypes (`EMBEDDING_DTYPES`):
  * `float32`: the engine's float32 values, as they are.
  * `float16`: IEEE half (`np.float16`), round-to-nearest-even.
  * `bfloat16`: the top 16 bits of float32 with round-to-nearest-even (torch's cast), held as `np.uint16`
    bit patterns (numpy has no bfloat16): `torch.from_numpy(x).view(torch.bfloat16)` reads them.
    On the GPU the tower runs in bfloat16, so this is its own output, exactly.

The ingress casts numpy arrays (float32 answers of the encoder) with numpy alone, the same rounding as torch's
casts: it never imports torch (tensors, on the replica side, go through torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from encoder.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

EMBEDDING_DTYPES = ("float32", "float16", "bfloat16")
_VIEW = {"float16": np.float16, "bfloat16": np.uint16}
_NUMPY = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}

# (tokens [n, out_dim], [deepstack layer [n, out_dim], ...], (t, h, w)), arrays in the wire dtype
WireLLM = tuple[np.ndarray, list[np.ndarray], tuple[int, int, int]]
# What a video's `WireLLM` carries after its grid, in this order (`encoder.outputs.LLMOutput`'s fields): Qwen3-VL's
# `timestamps` (seconds of each temporal patch, its prompt's `<t seconds>`) and Qwen2/2.5-VL's `second_per_grid_ts`
# (the seconds one temporal patch spans, which Qwen2.5-VL's M-RoPE steps its temporal positions by); None where the
# tower has no such fact.
VIDEO_FACTS = ("timestamps", "second_per_grid_ts")


def check_dtype(dtype: str) -> str:
    """The wire dtype's name, checked; anything else (a numpy or torch dtype included) is named by its type."""
    if isinstance(dtype, str) and dtype in EMBEDDING_DTYPES:
        return dtype
    if isinstance(dtype, str):
        named = repr(dtype)[:40]
    else:
        named, text = f"of type {type(dtype).__name__}", str(dtype)
        if " at 0x" not in text and len(text) <= 40:  # np.float16, torch.float16: their names help
            named += f" ({text})"
    raise InvalidArgumentError(f"unknown dtype {named}; expected one of {', '.join(EMBEDDING_DTYPES)} (a string)")


def wire_itemsize(dtype: str) -> int:
    """Bytes per element of the wire `dtype`."""
    return _NUMPY[check_dtype(dtype)].itemsize


def wire_torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype the engine casts to on the device for the wire `dtype`."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[check_dtype(dtype)]


def _bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even; NaN -> 0xFFFF (a NaN, and what
    torch's vectorised CPU cast gives: the bits equal the torch path this replaces)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16  # no overflow: finite and inf stay below 2**32
    out = rounded.astype(np.uint16)
    out[np.isnan(x)] = 0xFFFF
    return out


def to_wire(x: torch.Tensor | np.ndarray, dtype: str) -> np.ndarray:
    """A CPU tensor or array -> a C-contiguous numpy array in the wire `dtype`; one already in it (and
    C-contiguous) is returned as it is, a tensor as a view of its memory."""
    if isinstance(x, np.ndarray):
        if x.dtype == _NUMPY[dtype]:
            return np.ascontiguousarray(x)
        if dtype == "bfloat16":
            return _bfloat16_bits(x)
        with np.errstate(over="ignore"):  # beyond float16's range is inf, as torch's cast gives
            return np.ascontiguousarray(x, dtype=_NUMPY[dtype])  # float16: IEEE round to nearest even, as torch
    import torch

    if x.dtype == wire_torch_dtype(dtype) and x.is_contiguous() and dtype != "float32":
        return x.view(torch.int16).numpy().view(_VIEW[dtype])
    if dtype == "float32":
        return np.ascontiguousarray(x.numpy(), dtype=np.float32)
    # torch's casts are vectorised and round to nearest even (bfloat16: the top 16 bits, rounded)
    return x.to(wire_torch_dtype(dtype)).contiguous().view(torch.int16).numpy().view(_VIEW[dtype])


def from_wire(x: np.ndarray) -> np.ndarray:
    """A wire array back to float32 (tests and clients; bfloat16 bit patterns are uint16)."""
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def wire_outputs(outputs, dtype: str) -> list[WireLLM]:
    """`encoder.outputs.LLMOutput`s -> `WireLLM` tuples in `dtype`."""
    return [
        (to_wire(o.tokens, dtype), [to_wire(d, dtype) for d in o.deepstack], tuple(int(v) for v in o.grid_thw))
        for o in outputs
    ]


def video_facts(wire: tuple) -> dict:
    """The facts after a video's `WireLLM` grid (`VIDEO_FACTS`) that are not None, by name: `{"timestamps": [t
    floats]}` (Qwen3-VL) or `{"second_per_grid_ts": float}` (Qwen2/2.5-VL); `{}` for an image."""
    return {name: value for name, value in zip(VIDEO_FACTS, wire[3:], strict=False) if value is not None}


def handle_item(wire: WireLLM) -> dict:
    """The handle API's per-image dict: `{"tokens", "deepstack", "grid_thw"}`, a video's facts too (`video_facts`:
    `"timestamps"` for Qwen3-VL, `"second_per_grid_ts"` for Qwen2/2.5-VL)."""
    tokens, deepstack, grid = wire[:3]
    return {"tokens": tokens, "deepstack": list(deepstack), "grid_thw": list(grid)} | video_facts(wire)
