"""How the encoder runs fast: bucket table, static workspaces, CUDA graph capture and replay."""

from .buckets import BucketError, BucketKey, BucketTable, Pack
from .graph_encoder import GraphEncoder
from .runner import GraphCaptureError, GraphRunner

__all__ = ["BucketError", "BucketKey", "BucketTable", "GraphCaptureError", "GraphEncoder", "GraphRunner", "Pack"]
