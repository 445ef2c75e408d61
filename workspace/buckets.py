"""Bucket table and packer for CUDA-graph vision encoding.

A bucket is a token budget (total patches packed across images) plus a maximum image count. One CUDA
graph is captured per bucket, so every batch must be mapped onto a bucket it fits, padded up to the
budget. This module is pure Python (no torch) so the router and the CLI can use it cheaply. Which table a
process uses is `workspace.tables`' decision.

- `BucketKey`: one bucket, ordered by (budget, max_images).
- `BucketTable`: an immutable, budget-sorted set of buckets with `bucket_for` and `pack`.
- `Pack`: one group of consecutive input images and the bucket it runs in (None = eager, no graph).

Invariant kept by `BucketTable`: `max_images` never decreases as the budget grows. With it, "fits some
bucket" equals "fits the largest bucket", and the smallest fitting bucket is found with two bisections.
"""

from __future__ import annotations

import operator
import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

__all__ = ["MAX_BUDGET", "BucketError", "BucketKey", "BucketTable", "Pack", "default_table"]


class BucketError(ValueError):
    """A bucket spec, bucket table or patch count is invalid."""


def _positive_int(value: object, what: str) -> int:
    # bool is an int subclass; True as a budget is always a bug, so refuse it explicitly.
    if isinstance(value, bool):
        raise BucketError(f"{what} must be a positive int, got bool {value!r}")
    try:
        number = operator.index(value)  # accepts numpy ints, refuses floats and strings
    except TypeError:
        raise BucketError(f"{what} must be a positive int, got {type(value).__name__} {value!r}") from None
    if number <= 0:
        raise BucketError(f"{what} must be a positive int, got {number}")
    return number


@dataclass(frozen=True, order=True)
class BucketKey:
    """One captured graph shape: at most `budget` total patches over at most `max_images` images."""

    budget: int
    max_images: int

    def __post_init__(self) -> None:
        # Normalise (e.g. numpy ints) so keys hash and compare equal to plain-int keys.
        object.__setattr__(self, "budget", _positive_int(self.budget, "BucketKey.budget"))
        object.__setattr__(self, "max_images", _positive_int(self.max_images, "BucketKey.max_images"))

    def fits(self, total: int, num_images: int) -> bool:
        return total <= self.budget and num_images <= self.max_images


@dataclass(frozen=True)
class Pack:
    """Images `indices` (positions in the packed list, ascending) run together in bucket `key`."""

    key: BucketKey | None  # None: no bucket fits, run eagerly without a graph
    indices: tuple[int, ...]
    total: int  # real (unpadded) patches

    def __post_init__(self) -> None:
        if not self.indices:
            raise BucketError("a Pack needs at least one image index")
        if self.key is not None and not self.key.fits(self.total, len(self.indices)):
            raise BucketError(f"{len(self.indices)} images / {self.total} patches do not fit {self.key}")

    @property
    def padded(self) -> int:
        """Padding patches the graph runs on top of the real ones (0 for an eager pack)."""
        return 0 if self.key is None else self.key.budget - self.total


#: the largest budget of the default tables (`default_table`, `workspace.tables`): a batch that fills the GPU;
#: an attention backend may cap it lower (`max_graph_tokens`)
MAX_BUDGET = 32768

_POW2_SPEC = re.compile(r"pow2:\s*(\d+)\s*-\s*(\d+)")


class BucketTable:
    """Immutable set of buckets sorted ascending by budget (budgets unique, max_images non-decreasing)."""

    __slots__ = ("_keys", "_budgets", "_max_images")

    def __init__(self, keys: Iterable[BucketKey]) -> None:
        ordered = tuple(sorted(keys))
        if not ordered:
            raise BucketError("a BucketTable needs at least one bucket")
        for key in ordered:
            if not isinstance(key, BucketKey):
                raise BucketError(f"expected BucketKey, got {type(key).__name__} {key!r}")
        for prev, cur in zip(ordered, ordered[1:], strict=False):
            if prev.budget == cur.budget:
                raise BucketError(f"duplicate bucket budget {cur.budget}: {prev} and {cur}")
            # A bigger graph that accepts fewer images would make the packer's "fits the largest bucket"
            # rule split runs that some smaller graph could take, and would defeat the O(log b) lookup.
            if cur.max_images < prev.max_images:
                raise BucketError(f"max_images must not decrease as the budget grows: {prev} is followed by {cur}")
        object.__setattr__(self, "_keys", ordered)
        object.__setattr__(self, "_budgets", tuple(k.budget for k in ordered))
        object.__setattr__(self, "_max_images", tuple(k.max_images for k in ordered))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("BucketTable is immutable")

    def __reduce__(self):
        # rebuilt from its keys: tables travel through Ray (pickle) to replicas and routers
        return (BucketTable, (self._keys,))

    # -- constructors ------------------------------------------------------------------------------------

    @classmethod
    def from_budgets(
        cls,
        budgets: Iterable[int],
        max_images: int | Callable[[int], int] | None = None,
        granule: int = 1,
        min_patches_per_image: int = 16,
    ) -> BucketTable:
        """Buckets for `budgets`; max_images is fixed, a function of the budget, or budget // min_patches.

        Every budget must be a multiple of `granule` (Qwen2.5-VL's window layout needs multiples of 4).
        """
        granule = _positive_int(granule, "granule")
        min_patches = _positive_int(min_patches_per_image, "min_patches_per_image")
        keys = []
        for raw in budgets:
            budget = _positive_int(raw, "budget")
            if budget % granule:
                raise BucketError(f"budget {budget} is not a multiple of the granule {granule}")
            if max_images is None:
                limit = max(1, budget // min_patches)
            elif callable(max_images):
                limit = max_images(budget)
            else:
                limit = max_images
            keys.append(BucketKey(budget, _positive_int(limit, f"max_images for budget {budget}")))
        return cls(keys)

    @classmethod
    def powers_of_two(cls, min_budget: int, max_budget: int, **kwargs) -> BucketTable:
        """Budgets min, 2*min, 4*min, ..., max; max must be min times a power of two (else BucketError)."""
        low = _positive_int(min_budget, "min_budget")
        high = _positive_int(max_budget, "max_budget")
        if low > high:
            raise BucketError(f"min_budget {low} is larger than max_budget {high}")
        budgets = [low]
        while budgets[-1] < high:
            budgets.append(budgets[-1] * 2)
        # Silently stopping short of max (or overshooting it) would change the largest graph, hence
        # the admission limit, behind the operator's back.
        if budgets[-1] != high:
            raise BucketError(f"max_budget {high} is not min_budget {low} times a power of two")
        return cls.from_budgets(budgets, **kwargs)

    @classmethod
    def parse(cls, spec: str | Iterable[int], **kwargs) -> BucketTable:
        """Table from a list of ints, "256,1024,4096" or "pow2:256-32768"; kwargs go to from_budgets."""
        if not isinstance(spec, str):
            # bytes would iterate as their character codes (b"256" -> budgets 50, 53, 54); an int is not a list
            if isinstance(spec, bytes | bytearray) or not isinstance(spec, Iterable):
                raise BucketError(
                    f"bad bucket spec {spec!r}: expected a string such as '256,1024,4096' or 'pow2:256-32768', "
                    "or a list of budgets"
                )
            return cls.from_budgets(list(spec), **kwargs)
        text = spec.strip()
        if text.lower().startswith("pow2"):
            match = _POW2_SPEC.fullmatch(text.lower())
            if match is None:
                raise BucketError(f"bad bucket spec {spec!r}: expected 'pow2:MIN-MAX', e.g. 'pow2:256-32768'")
            return cls.powers_of_two(int(match[1]), int(match[2]), **kwargs)
        budgets = []
        for token in text.split(","):
            token = token.strip()
            if not token.isdecimal():
                raise BucketError(
                    f"bad bucket spec {spec!r}: {token!r} is not a positive integer "
                    "(expected e.g. '256,1024,4096' or 'pow2:256-32768')"
                )
            budgets.append(int(token))
        return cls.from_budgets(budgets, **kwargs)

    # -- container protocol --------------------------------------------------------------------------------

    @property
    def keys(self) -> tuple[BucketKey, ...]:
        return self._keys

    @property
    def largest(self) -> BucketKey:
        return self._keys[-1]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[BucketKey]:
        return iter(self._keys)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketTable) and self._keys == other._keys

    def __hash__(self) -> int:
        return hash(self._keys)

    def __repr__(self) -> str:
        return f"BucketTable({list(self._keys)!r})"

    # -- lookup and packing --------------------------------------------------------------------------------

    def bucket_for(self, total_patches: int, num_images: int) -> BucketKey | None:
        """The smallest-budget bucket with budget >= total_patches and max_images >= num_images, or None."""
        # Both columns are sorted, so the answer is the later of the two first-fit positions.
        i = max(bisect_left(self._budgets, total_patches), bisect_left(self._max_images, num_images))
        return self._keys[i] if i < len(self._keys) else None

    def pack(self, counts: Iterable[int]) -> list[Pack]:
        """Split images (given by patch count) into consecutive packs, in input order.

        Greedy: each run is extended while it still fits the largest bucket, then gets the smallest
        bucket that fits it. An image larger than the largest budget gets its own eager pack (key None).
        O(n + packs * log b).
        """
        cap = self.largest
        packs: list[Pack] = []
        run: list[int] = []
        run_total = 0

        def flush() -> None:
            if run:
                packs.append(Pack(self.bucket_for(run_total, len(run)), tuple(run), run_total))

        for index, raw in enumerate(counts):
            count = _positive_int(raw, f"patch count of image {index}")
            if count > cap.budget:
                flush()
                run, run_total = [], 0
                packs.append(Pack(None, (index,), count))
            elif run_total + count > cap.budget or len(run) == cap.max_images:
                flush()
                run, run_total = [index], count
            else:
                run.append(index)
                run_total += count
        flush()
        return packs


def default_table(max_budget: int = MAX_BUDGET, min_budget: int = 256) -> BucketTable:
    """The engine's default: one 224x224 image as the model's processor sizes it (`min_budget`: 256 patches for
    Qwen2.5-VL at patch 14, and for Qwen3-VL at patch 16, whose processor scales 224² up to 256²)
    times the powers of two, up to `max_budget` patches (a batch that fills the GPU); up to one image per
    64 patches (112x112), at most 256 images per replay. Budgets on a model's own 224^2 unit keep common
    batches (n images of 224 * 2^k pixels a side) exactly at a bucket's budget, with no padding."""
    low = _positive_int(min_budget, "min_budget")
    budgets = [low]
    while budgets[-1] * 2 <= max_budget:
        budgets.append(budgets[-1] * 2)
    return BucketTable.from_budgets(budgets, max_images=lambda b: max(1, min(b // 64, 256)), granule=4)
