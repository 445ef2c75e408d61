"""How the encoder is served: the Ray Serve application, its request router and the batch jobs.

`serve run deployments:app` (embedded `tiny` preset, CPU or GPU) or
`serve run deployments:build_app model=/path/to/checkpoint num_replicas=2`; see `AppArgs` for every
argument. Attributes load lazily, so `import deployments.batch` (or the router) does not build an
application or import Ray Serve's HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deployments.application import build_app
    from deployments.config import AppArgs

__all__ = ["AppArgs", "app", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from deployments.application import build_app

        return build_app
    if name == "AppArgs":
        from deployments.config import AppArgs

        return AppArgs
    if name == "app":  # the default application, built on first access (`serve run deployments:app`)
        from deployments.application import build_app

        return build_app({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
