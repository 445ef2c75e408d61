"""What an encoder replica publishes to the request routers, and how a router reads it back.

A replica returns `BucketRoutingStats(...).to_dict()` from `record_routing_stats()` (polled by Serve every
`request_routing_stats_period_s`) and from `record_replica_metadata()` (published once at start-up, so
the table is known before the first poll); the `BucketRouter` reads them with `published(replica)`.

The keys (`STATS_*`):

- `"buckets"`: the replica's bucket table as `[[budget, max_images], ...]` ascending (bare budgets are
  accepted too). The `BucketRouter` uses the table most replicas report; with none it uses
  `BucketRouterConfig.buckets`, else `workspace.tables.router_fallback_table()` (the engine's default).
- `"ready"`: False while the replica cannot serve (graphs not captured); such replicas rank last.
- `"queued_by_bucket"`: `{budget: queued requests}`, for dashboards and future policies. Not used to
  route: Serve polls these stats every `request_routing_stats_period_s` (10 s by default) and relays
  them through the controller, far too stale for load balancing. Load comes from Ray's own per-replica
  queue-length cache instead, refreshed by every send and by probes.

The same keys are also read from `record_replica_metadata()` (published once when a replica becomes
ready, so the table is known before the first stats poll); routing stats win when both are present.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray.serve.request_router import RunningReplica

from workspace.buckets import BucketError, BucketKey, BucketTable

STATS_BUCKETS = "buckets"
"""The replica's bucket table: `[[budget, max_images], ...]` ascending (or bare budgets)."""
STATS_QUEUED_BY_BUCKET = "queued_by_bucket"
"""`{budget: requests queued or running}` on the replica (informational)."""
STATS_READY = "ready"
"""False while the replica cannot serve; the router ranks it last."""
STATS_MAX_BATCH_PATCHES = "max_batch_patches"
"""Patches the replica runs in one batch (its callers send calls up to this size): the router's unit of
in-flight work, where it exceeds the largest bucket (a CPU replica runs 8192 patches over 1024-patch buckets)."""


class BucketRoutingStats(BaseModel):
    """The dict a replica returns from `record_routing_stats()` (build it with `from_table(...).to_dict()`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    buckets: tuple[tuple[int, int] | int, ...] = Field(min_length=1)
    queued_by_bucket: dict[int, int] = Field(default_factory=dict)
    ready: bool = True
    max_batch_patches: int | None = Field(None, ge=1)

    @field_validator("buckets", mode="before")
    @classmethod
    def _lists_to_tuples(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return tuple(tuple(v) if isinstance(v, list) else v for v in value)
        return value

    @classmethod
    def from_table(
        cls,
        table: BucketTable,
        queued_by_bucket: Mapping[int, int] | None = None,
        ready: bool = True,
        max_batch_patches: int | None = None,
    ) -> BucketRoutingStats:
        return cls(
            buckets=tuple((k.budget, k.max_images) for k in table.keys),
            queued_by_bucket=dict(queued_by_bucket or {}),
            ready=ready,
            max_batch_patches=max_batch_patches,
        )

    def table(self) -> BucketTable:
        """The published table; BucketError if it is not a valid one."""
        pairs = [b for b in self.buckets if isinstance(b, tuple)]
        if not pairs:
            return BucketTable.from_budgets(self.buckets)
        if len(pairs) != len(self.buckets):
            raise BucketError(f"mixed bare budgets and [budget, max_images] pairs: {self.buckets!r}")
        return BucketTable(BucketKey(budget, max_images) for budget, max_images in pairs)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists, ints and bools: the exact shape the router parses."""
        return {
            STATS_BUCKETS: [list(b) if isinstance(b, tuple) else b for b in self.buckets],
            STATS_QUEUED_BY_BUCKET: dict(self.queued_by_bucket),
            STATS_READY: self.ready,
            **({STATS_MAX_BATCH_PATCHES: self.max_batch_patches} if self.max_batch_patches else {}),
        }


def published(replica: RunningReplica) -> Mapping[str, Any]:
    """The replica's routing stats if they carry a table, else its replica metadata, else {}."""
    stats = getattr(replica, "routing_stats", None)
    if isinstance(stats, Mapping) and STATS_BUCKETS in stats:
        return stats
    try:
        metadata = getattr(replica, "replica_metadata", None)
    except Exception:  # a replica wrapper without metadata support
        metadata = None
    if isinstance(metadata, Mapping) and STATS_BUCKETS in metadata:
        merged = dict(metadata)
        if isinstance(stats, Mapping):
            merged.update(stats)
        return merged
    return stats if isinstance(stats, Mapping) else {}
