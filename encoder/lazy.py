"""PEP 562 lazy exports for packages whose submodules import torch.

A package names what it exports and from which submodule; `lazy_exports` builds its module `__getattr__`,
which imports the submodule on first use and caches the value in the package. So processes that only decode,
check and route images import the packages without torch (`tests/unit/test_architecture.py` holds that).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package`: name -> the same name in `package.<exports[name]>`, loaded once."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = vars(import_module(f".{exports[name]}", package))[name]
        vars(sys.modules[package])[name] = value
        return value

    return __getattr__
