"""How the encoder runs fast: bucket table, static workspaces, CUDA graph capture and replay."""

from importlib import import_module

from .buckets import BucketError, BucketKey, BucketTable, Pack

__all__ = ["BucketError", "BucketKey", "BucketTable", "GraphCaptureError", "GraphEncoder", "GraphRunner", "Pack"]

# The graph modules import torch; they load on first use (PEP 562), so the ingress can read bucket tables
# (`workspace.buckets`, `workspace.tables`) without importing torch.
_LAZY = {"GraphEncoder": "graph_encoder", "GraphCaptureError": "runner", "GraphRunner": "runner"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = vars(import_module(f".{_LAZY[name]}", __name__))[name]
    globals()[name] = value
    return value
