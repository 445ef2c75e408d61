"""Shared test set-up: the GPU marker, Triton's CPU interpreter, and the session's Ray instance.

`tests/unit/` needs no Ray cluster; `tests/integration/` (serve, batch, cluster) shares one Ray instance per
session (`ray_cluster`, from `tests/serve_fixtures.py` with the other Serve helpers).
"""

import os

import pytest
import torch

# Triton kernels run under the CPU interpreter when there is no GPU; the variable must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # the GPU machine has no Ray: its unit tests run without the service fixtures
    from tests.serve_fixtures import ray_cluster  # noqa: E402, F401 - the session fixture, for every test module
except ImportError as exc:
    if exc.name != "ray":
        raise


def pytest_collection_modifyitems(config, items):
    # Modules that replace the session's shared Ray instance with one of their own (`own_ray`) run last, so
    # nothing waits for the shared one to be started again after them (~15 s: Ray, then Serve).
    items.sort(key=lambda item: "own_ray" in item.keywords)  # stable: the order within each group is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
