"""How the encoder runs fast: bucket table, static workspaces, CUDA graph capture and replay."""

from encoder.lazy import lazy_exports
from workspace.buckets import BucketError, BucketKey, BucketTable, Pack

__all__ = ["BucketError", "BucketKey", "BucketTable", "GraphCaptureError", "GraphEncoder", "GraphRunner", "Pack"]

# The graph modules import torch; they load on first use (PEP 562), so the ingress can read bucket tables
# (`workspace.buckets`, `workspace.tables`) without importing torch.
_LAZY = {"GraphEncoder": "graph_encoder", "GraphCaptureError": "runner", "GraphRunner": "runner"}


__getattr__ = lazy_exports(__name__, _LAZY)
