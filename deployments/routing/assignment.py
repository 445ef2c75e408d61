"""Which replicas own which buckets: pure functions the `BucketRouter` calls.

Assignment of buckets to replicas (`assign_buckets`), a pure function of the table and the set of
replica ids, so every router process (proxy, driver, each ingress replica) computes the same map:

- `"ranges"` (default): replicas sorted by id split the budget-sorted buckets into contiguous ranges
  (counts differ by at most one; lower ids own the smaller buckets, the earlier ranges are the
  longer ones); with more replicas than buckets each bucket gets a contiguous block of replicas
  (blocks differ by at most one, the larger blocks go to the largest buckets). Contiguous ranges
  keep small and large images on different replicas, which is what the latency goal needs: with
  the default table (256..32768) and two replicas, 224x224 (256 patches) and 1344x1344 (9216 -> 16384)
  always land on different replicas. Interleaving (bucket of rank r to replica r % n) puts those two on the same
  replica, and rendezvous hashing does so for about one replica-id pair in three.
- `"rendezvous"`: highest-random-weight hashing of (bucket, replica id) with bounded loads (largest
  bucket first; owned counts differ by at most one, as with ranges): a replica set change moves
  fewer buckets (default table, 2-6 random replicas: a join moves 2.5 of 8 buckets against 3.2 for
  ranges; a leave moves 0.45 buckets beyond the leaver's own against 0.86), at the price of random
  size mixing.

Ownership moving is cheap here: every replica captured every bucket, so an owner is only a routing
preference; no state moves. Hence the default favours size separation and exact balance over
minimal movement. Both schemes are deterministic for a given replica set.

`request_size` reads an image request's size (patches, images) from its keyword arguments, `text_size` a text
request's (tokens, texts).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Mapping
from typing import Any

from ray.serve.request_router import PendingRequest

from workspace.buckets import BucketKey, BucketTable

ASSIGNMENT_STRATEGIES = ("ranges", "rendezvous")


def _count(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number > 0 else None


def request_size(
    pending_request: PendingRequest | None, num_patches_kwarg: str = "num_patches", num_images_kwarg: str = "num_images"
) -> tuple[int, int] | None:
    """(total patches, images) of a request, or None when it carries no usable patch count."""
    if pending_request is None or not isinstance(pending_request.kwargs, Mapping):
        return None
    raw = pending_request.kwargs.get(num_patches_kwarg)
    if raw is None:
        return None
    total = _count(raw)
    if total is not None:
        images = _count(pending_request.kwargs.get(num_images_kwarg, 1))
        return (total, images) if images is not None else None
    if isinstance(raw, str | bytes) or not isinstance(raw, Iterable):
        return None
    counts = [_count(c) for c in raw]
    if not counts or None in counts:
        return None
    return sum(counts), len(counts)


def _owner_slots(num_buckets: int, num_replicas: int) -> list[int]:
    """Owners per bucket (ascending budget): 1 each, or a share of the replicas when they outnumber buckets."""
    if num_replicas <= num_buckets:
        return [1] * num_buckets
    base, extra = divmod(num_replicas, num_buckets)
    return [base + (1 if i >= num_buckets - extra else 0) for i in range(num_buckets)]


def _score(key: BucketKey, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key.budget}/{key.max_images}/{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign_buckets(
    table: BucketTable, replica_ids: Iterable[str], strategy: str = "ranges"
) -> dict[BucketKey, tuple[str, ...]]:
    """Owner replica ids (sorted) of every bucket; a pure function of the table and the set of ids.

    With no replicas every bucket has no owner. See the module docstring for the two strategies.
    """
    if strategy not in ASSIGNMENT_STRATEGIES:
        raise ValueError(f"unknown assignment strategy {strategy!r}; expected one of {ASSIGNMENT_STRATEGIES}")
    ids = sorted(set(replica_ids))
    keys = table.keys
    if not ids:
        return {key: () for key in keys}
    slots = _owner_slots(len(keys), len(ids))
    owners: dict[BucketKey, tuple[str, ...]] = {}
    if strategy == "ranges":
        if len(ids) <= len(keys):
            base, extra = divmod(len(keys), len(ids))
            start = 0
            for rank, rid in enumerate(ids):
                stop = start + base + (1 if rank < extra else 0)
                for key in keys[start:stop]:
                    owners[key] = (rid,)
                start = stop
        else:
            start = 0
            for key, count in zip(keys, slots, strict=True):
                owners[key] = tuple(ids[start : start + count])
                start += count
        return owners
    # Rendezvous with bounded loads: largest bucket first, each takes its highest-scoring replicas
    # that still have room. Loads end at floor or ceil of slots / replicas: every replica may hold
    # `floor`, and only `extra` of them one more. The room left always equals the slots left, and
    # when replicas outnumber buckets (floor 1, extra 0) every replica not yet chosen is free.
    floor, extra = divmod(sum(slots), len(ids))
    load = dict.fromkeys(ids, 0)
    above_floor = 0
    for key, count in zip(reversed(keys), reversed(slots), strict=True):
        ranked = sorted(ids, key=lambda rid, key=key: (_score(key, rid), rid), reverse=True)
        chosen: list[str] = []
        for rid in ranked:
            if len(chosen) == count:
                break
            if load[rid] < floor or (load[rid] == floor and above_floor < extra):
                above_floor += load[rid] == floor
                load[rid] += 1
                chosen.append(rid)
        owners[key] = tuple(sorted(chosen))
    return {key: owners[key] for key in keys}


def text_size(
    pending_request: PendingRequest | None, num_tokens_kwarg: str = "num_tokens", num_texts_kwarg: str = "num_texts"
) -> tuple[int, int] | None:
    """(tokens, texts) of a text request (`wire.TextRequest.call`: tokens are texts x the text tower's length), or
    None when it carries no usable token count (an image request, another method)."""
    if pending_request is None or not isinstance(pending_request.kwargs, Mapping):
        return None
    tokens = _count(pending_request.kwargs.get(num_tokens_kwarg))
    texts = _count(pending_request.kwargs.get(num_texts_kwarg, 1))
    return (tokens, texts) if tokens is not None and texts is not None else None
