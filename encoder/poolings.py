"""The pooling names every tower accepts (no torch: the ingress and the batch CLI check names with it)."""

from __future__ import annotations

from encoder.errors import InvalidArgumentError, named

POOLINGS = ("none", "mean", "model", "mean-l2", "model-l2")


def check_pooling(pooling: str) -> None:
    """The name is known (family-independent; `encoder.api.resolve_pooling` checks that the model supports it)."""
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise InvalidArgumentError(f"unknown pooling {named(pooling)}; expected one of {', '.join(POOLINGS)}")
