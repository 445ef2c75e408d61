"""Attention backends behind one varlen interface (see `base.AttentionBackend`).

`get_backend(name)` returns a ready instance or raises `BackendUnavailableError` listing the
backends that can run here, so a bad choice fails at load, never at graph capture;
`resolve_attention` maps a model's layer kinds to backends (`auto`: the fastest per kind and shape).
"""

from __future__ import annotations

from encoder.attention.auto import (
    AutoAttention,
    describe_backend,
    graph_token_cap,
    missing_faster_backend,
    resolve_attention,
)
from encoder.attention.base import AttentionBackend
from encoder.attention.registry import DEFAULT_BACKEND, available_backends, backend_names, get_backend, register

__all__ = [
    "AttentionBackend",
    "AutoAttention",
    "DEFAULT_BACKEND",
    "available_backends",
    "backend_names",
    "describe_backend",
    "missing_faster_backend",
    "get_backend",
    "graph_token_cap",
    "register",
    "resolve_attention",
]
