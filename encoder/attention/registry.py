"""The backend registry: names -> classes, loaded lazily so optional packages stay optional."""

from __future__ import annotations

import importlib

from encoder.attention.base import AttentionBackend
from encoder.errors import BackendUnavailableError

# name -> "module:Class"; modules are imported lazily so optional packages stay optional
_REGISTRY: dict[str, str] = {
    "sdpa": "encoder.attention.sdpa:SdpaAttention",
    "triton": "encoder.attention.triton_varlen:TritonVarlenAttention",
    "torch_varlen": "encoder.attention.torch_varlen:TorchVarlenAttention",
    "flash_attn": "encoder.attention.flash:FlashAttn2",
    "fa3": "encoder.attention.flash:FlashAttn3",
    "fa4": "encoder.attention.flash:FlashAttn4",
}

DEFAULT_BACKEND = "sdpa"  # the reference; what `auto` resolves to on CPU


def register(name: str, target: str) -> None:
    _REGISTRY[name] = target


def _load_class(name: str) -> type[AttentionBackend] | str:
    """The backend class, or a string saying why it cannot be used here."""
    module_name, _, cls_name = _REGISTRY[name].partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:  # a registered "module:Class" whose class is not there
        return f"{_REGISTRY[name]}: import failed ({type(exc).__name__}: {exc})"
    reason = cls.unavailable_reason()
    return reason if reason else cls


def backend_class(name: str) -> type[AttentionBackend] | None:
    """The backend's class whether or not its package is installed here (None: its module does not import)."""
    module_name, _, cls_name = _REGISTRY[name].partition(":")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError):
        return None


def backend_names() -> list[str]:
    return list(_REGISTRY)


def available_backends() -> dict[str, str | None]:
    """name -> None if usable here, else the reason it is not."""
    out = {}
    for name in _REGISTRY:
        got = _load_class(name)
        out[name] = got if isinstance(got, str) else None
    return out


def get_backend(name: str | None = None) -> AttentionBackend:
    name = name or DEFAULT_BACKEND
    if name not in _REGISTRY:
        raise BackendUnavailableError(f"unknown attention backend {name!r}; known: {', '.join(_REGISTRY)}")
    got = _load_class(name)
    if isinstance(got, str):
        usable = [n for n, why in available_backends().items() if why is None]
        raise BackendUnavailableError(
            f"attention backend {name!r} is not available here ({got}); available: {', '.join(usable)}"
        )
    return got()
