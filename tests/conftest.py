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
    (docs/journal/benchmarks.md, tenth session). Python writes them itself on first import wherever the variable
    is unset; `compileall` skips the files whose bytecode is up to date."""
    if not sys.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):  # workers: their controller did
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


# Under pytest-xdist (`-n 2`, README "Tests") the unit of work is a whole test module: each module deploys its
# application once (module-scoped fixtures), in the worker that runs it, where xdist's default would split a module
# over the workers and deploy its application in each. The modules that start Ray instances of their own (marked
# `own_ray` or `spawns_ray`, listed here because xdist's controller sees test ids, not marks) go together, one after
# another in one worker: two of them side by side on a 2-core box once made a node's start time out after 40 s
# (docs/journal/benchmarks.md, tenth session). `pytest_collection_modifyitems` checks the list against the marks.
RAY_OF_ITS_OWN = "ray-of-its-own"
RAY_OF_ITS_OWN_MODULES = frozenset({
    "tests/integration/batch/test_batch_example.py",
    "tests/integration/batch/test_batch_reaper.py",
    "tests/integration/cluster/test_multinode.py",
    "tests/integration/serve/test_default_path_limits.py",
    "tests/integration/serve/test_examples_local.py",
    "tests/integration/serve/test_launcher_config.py",
    "tests/integration/serve/test_proxy_limits.py",
    "tests/integration/serve/test_serve_fast_path.py",
    "tests/integration/serve/test_shutdown.py",
})  # fmt: skip


def starts_ray(item) -> bool:
    return "own_ray" in item.keywords or "spawns_ray" in item.keywords


def xdist_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under xdist: its module, or the group of modules with a Ray of their own."""
    module = nodeid.split("::", 1)[0]
    return RAY_OF_ITS_OWN if module in RAY_OF_ITS_OWN_MODULES else module


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`-n N` without `--dist`: whole modules (`xdist_unit`), in the order `pytest_collection_modifyitems` gives
    them, not xdist's default of the largest first. Runs before xdist's own hook (registered later, called first),
    which leaves a chosen mode alone."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's `loadfile` with the own-Ray modules as one unit. (Not `loadgroup` with `xdist_group` marks: with
    pytest 9.2 xdist 3.8 groups nothing, as pytest-dev/pytest-xdist#1386 reports; measured here on 2026-12-03,
    every module was split over both workers and most applications were deployed twice.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    # Modules that replace the session's shared Ray instance with one of their own (`own_ray`) run first: before
    # anything has started the shared one, which would then be shut down and started again after them (~15 s:
    # Ray, then Serve). Then those that start Ray in subprocesses (`spawns_ray`): the shared instance is not up
    # yet to take its share of the CPU. Then the other `slow` tests, the fast ones last. Under xdist that puts
    # the longest group first and leaves the workers small pieces of work at the end.
    items.sort(key=lambda item: ("own_ray" not in item.keywords, not starts_ray(item), "slow" not in item.keywords))
    unlisted = {i.nodeid.split("::")[0] for i in items if starts_ray(i) != (xdist_unit(i.nodeid) == RAY_OF_ITS_OWN)}
    if unlisted:
        why = f"RAY_OF_ITS_OWN_MODULES and the own_ray/spawns_ray marks disagree on {sorted(unlisted)}"
        pytest.exit(f"tests/conftest.py: {why}", returncode=4)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
