"""`attention="auto"`: the fastest usable backend per layer kind and per graph shape.

A tower's layers are of kinds: "full" (attention over whole images) and, for Qwen2.5-VL, "window"
(64-token windows). Each kind gets its own `AutoAttention`, which picks a backend at every call
from the call's static `max_seqlen` bound and head dim: inside a CUDA graph that is the shape's
bound, so each captured shape bakes in its own choice (a 1 x 224² pack and an 8 x 896² pack of the
same tower may run different kernels). The rule is a ranking measured on the H200 (graph replay,
bf16, 16 heads, `benchmarks/attention.py`, docs/journal/benchmarks.md 2026-12-01 second session, run 2; ms):

| segments          | hd | triton | torch_varlen | fa4   |
| ----------------- | -: | -----: | -----------: | ----: |
| 1 x 256           | 80 | 0.019  | 0.025        | 0.015 |
| 32 x 256          | 80 | 0.079  | 0.118        | 0.079 |
| 16 x 512          | 80 | 0.125  | 0.149        | 0.081 |
| 8 x 1024          | 80 | 0.213  | 0.229        | 0.122 |
| 8 x 4096          | 80 | 2.945  | 2.719        | 1.218 |
| 512 x 64 windows  | 80 | 0.149  | 0.350        | 0.580 |
| 32 x 256          | 72 | 0.564  | 0.110        | 0.087 |
| 8 x 4096          | 72 | 7.019  | 2.832        | 1.334 |

so: segments of at most `SHORT_SEGMENT` tokens with a head dim that is a multiple of 16 -> our
Triton kernel (it ties or wins there, and wins 64-token windows by 4x); longer segments, or head
dims such as 72 (which our kernel pads to 128 lanes) -> FA4, then torch's varlen flash kernel.
`sdpa` is last everywhere (and the only choice on CPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from encoder.attention.base import AttentionBackend
from encoder.attention.registry import available_backends, backend_class, get_backend
from encoder.errors import BackendUnavailableError, ConfigError

SHORT_SEGMENT = 256  # tokens: Triton ties or wins up to 256, FA4 wins from 512 on (16 x 512: 0.081 vs 0.125 ms)
SHORT_FIRST = ("triton", "torch_varlen", "fa4", "fa3", "flash_attn", "sdpa")
LONG_FIRST = ("fa4", "fa3", "torch_varlen", "flash_attn", "triton", "sdpa")


def ranking(max_seqlen: int, head_dim: int) -> tuple[str, ...]:
    """Backends fastest first for segments of up to `max_seqlen` tokens (the measured rule above)."""
    return SHORT_FIRST if max_seqlen <= SHORT_SEGMENT and head_dim % 16 == 0 else LONG_FIRST


class AutoAttention(AttentionBackend):
    """Dispatches each call to the first backend of `ranking` among `candidates` (usable here and
    supporting the model's device, dtype and head dim); records what it chose for `describe`."""

    name = "auto"

    def __init__(self, kind: str, candidates: Mapping[str, AttentionBackend]):
        if not candidates:
            raise BackendUnavailableError(f"no attention backend can run the {kind!r} layers here")
        self.kind = kind
        self.candidates = dict(candidates)
        caps = [b.max_graph_tokens for b in self.candidates.values() if b.max_graph_tokens is not None]
        # the cap of the slowest fallback only matters when it is the only choice
        self.max_graph_tokens = min(caps) if len(caps) == len(self.candidates) else None
        self.chosen: dict[int, str] = {}  # max_seqlen bound -> backend name

    def choose(self, max_seqlen: int, head_dim: int) -> AttentionBackend:
        name = next(n for n in ranking(max_seqlen, head_dim) + tuple(self.candidates) if n in self.candidates)
        self.chosen[max_seqlen] = name
        return self.candidates[name]

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        return self.choose(max_seqlen, q.shape[-1]).forward(q, k, v, cu_seqlens, max_seqlen, out)

    def describe(self) -> str:
        """e.g. "triton (segments <= 256), fa4 (<= 4096)": each backend with the largest bound it ran."""
        if not self.chosen:
            return f"auto (not run yet; candidates {', '.join(self.candidates)})"
        top: dict[str, int] = {}
        for bound, name in sorted(self.chosen.items()):
            top[name] = bound
        return ", ".join(f"{name} (segments <= {bound})" for name, bound in top.items())


def graph_token_cap(backends: Mapping[str, AttentionBackend]) -> int | None:
    """The largest bucket budget every layer kind's backend can be captured at (None: no limit)."""
    caps = [b.max_graph_tokens for b in backends.values() if b.max_graph_tokens is not None]
    return min(caps, default=None)


def describe_backend(backend: AttentionBackend) -> str:
    return backend.describe() if isinstance(backend, AutoAttention) else backend.name


# where `auto` would rank a backend that is not installed first, how to install it
INSTALL_HINTS = {"fa4": "pip install -e '.[gpu]' (FlashAttention-4)"}


def missing_faster_backend(backends: Mapping[str, AttentionBackend], device: torch.device) -> str | None:
    """For the start-up line: a backend `auto` ranks first for long segments (`LONG_FIRST`) that would run on this
    GPU but is not installed, with how to install it ("fa4: pip install ..."); None when the best one is here,
    on the CPU, or where no layer kind is `auto`."""
    autos = [b for b in backends.values() if isinstance(b, AutoAttention)]
    if device.type != "cuda" or not autos:
        return None
    faster = LONG_FIRST[: LONG_FIRST.index("torch_varlen")]  # the FlashAttention builds ranked above torch's
    if any(name in b.candidates for b in autos for name in faster):
        return None
    for name in faster:
        hint = INSTALL_HINTS.get(name)
        need = getattr(backend_class(name), "_min_capability", None)  # FA4's module imports without its package
        if hint is not None and need is not None and torch.cuda.get_device_capability(device) >= need:
            return f"{name} would be faster here: {hint}"
    return None


def _kind_choice(kind: str, name) -> str:
    """A mapping's value for one kind: a backend name, or "auto" (also for None or "", as at the top level)."""
    if name is None or name == "":
        return "auto"
    if not isinstance(name, str):
        raise ConfigError(
            f"attention for the {kind!r} layers must be a backend name or 'auto', not {type(name).__name__}"
        )
    return name


def resolve_attention(
    attention: str | Mapping[str, str] | None,
    kinds: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
) -> dict[str, AttentionBackend]:
    """kind -> backend for a tower with layers of `kinds`.

    `attention`: None or "auto" (the fastest usable per kind and shape; on CPU that is the sdpa
    reference), a backend name (forced for every kind), or a mapping kind -> name / "auto" (kinds it
    leaves out, or maps to None, are "auto"). A named backend that cannot run here, or this model, is a `ConfigError`
    naming it; "auto" never fails where sdpa runs."""
    if attention is None or isinstance(attention, str):
        per_kind = {kind: attention or "auto" for kind in kinds}
    elif isinstance(attention, Mapping):
        # keys compared and listed as given: a non-string key is named by its type, never by its repr
        unknown = sorted(repr(k) if isinstance(k, str) else type(k).__name__ for k in attention if k not in kinds)
        if unknown:
            raise ConfigError(
                f"attention names layer kinds [{', '.join(unknown)}]; this model has {list(kinds)} "
                "(use one backend name, 'auto', or a mapping of those kinds)"
            )
        per_kind = {kind: _kind_choice(kind, attention.get(kind)) for kind in kinds}
    else:
        raise ConfigError(
            f"attention must be a backend name, 'auto' or a mapping kind -> name, not {type(attention).__name__}"
        )

    usable: dict[str, AttentionBackend] | None = None
    out: dict[str, AttentionBackend] = {}
    for kind, name in per_kind.items():
        if name != "auto":
            backend = get_backend(name)
            why = backend.supports(device, dtype, head_dim)
            if why:
                raise ConfigError(f"attention backend {name!r} cannot run this model: {why}")
            out[kind] = backend
            continue
        if usable is None:
            usable = {}
            for n, reason in available_backends().items():
                if reason is None and (device.type == "cuda" or n == "sdpa"):
                    backend = get_backend(n)
                    if backend.supports(device, dtype, head_dim) is None:
                        usable[n] = backend
        out[kind] = AutoAttention(kind, usable)
    return out
