"""Shared test set-up: the GPU marker, Triton's CPU interpreter, and the session's Ray instance.

`tests/unit/` needs no Ray cluster; `tests/integration/` (serve, batch, cluster) shares one Ray instance per
session (`ray_cluster`, from `tests/serve_fixtures.py` with the other Serve helpers).
"""

import os
import sys
from pathlib import Path

import pytest
import torch


def _compile_the_project() -> None:
    """Write the project's bytecode where Python is told not to (PYTHONDONTWRITEBYTECODE=1, as on the project's
    CPU boxes). Every Ray replica, worker and subprocess the tests start imports these packages, and without
    .pyc files each one compiles them from source again: ~0.6 CPU-s per encoder or ingress replica
    (BENCHMARKS.md, tenth session). Python writes them itself on first import wherever the variable is unset;
    `compileall` skips the files whose bytecode is up to date."""
    if not sys.dont_write_bytecode:
        return
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in ("encoder", "workspace", "deployments", "tests", "examples"):
        compileall.compile_dir(root / package, quiet=2)  # quiet=2: a read-only checkout compiles on import


_compile_the_project()

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
