"""The pooling names every tower accepts (no torch: the ingress and the batch CLI check names with it)."""

from __future__ import annotations

from .errors import InvalidArgumentError

POOLINGS = ("none", "mean", "model", "mean-l2", "model-l2")


def check_pooling(pooling: str) -> None:
    """The name is known (family-independent; `encoder.api.resolve_pooling` checks that the model supports it)."""
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        shown = repr(pooling) if isinstance(pooling, str) else f"of type {type(pooling).__name__}"
        raise InvalidArgumentError(f"unknown pooling {shown}; expected one of {', '.join(POOLINGS)}")
