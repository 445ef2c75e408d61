"""`BucketRouter`: a Ray Serve request router that sends each request to the replicas owning its bucket.

Why: every encoder replica captured a CUDA graph per bucket (token budget), and its batcher packs
whatever is queued into the smallest bucket that fits. If small and large images share a
replica, a 256-patch request waits behind a 16k-patch replay; if same-size requests scatter over
all replicas, fewer of them meet in one batch. So the router keeps each request *size class* (the
bucket its own patch count maps to) on a stable set of owner replicas, balances by queue length
inside that set, and spills to the other replicas only when the owners are saturated.

Plugging it in (the encoder deployment, called as
`handle.encode_pixels.remote(pixels, pooling=..., num_patches=n, num_images=k)`)::

    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        request_router_config=RequestRouterConfig(
            request_router_class="deployments.routing.router.BucketRouter",  # or the class itself
            request_router_kwargs={"spill_fraction": 0.5},  # BucketRouterConfig fields, all optional
            request_routing_stats_period_s=2,  # how often Serve polls record_routing_stats
        ),
        max_ongoing_requests=512,
    )
    class Encoder:
        def record_routing_stats(self) -> dict:
            return BucketRoutingStats.from_table(self.table, queued_by_bucket=..., ready=True).to_dict()

The request: the router reads `pending_request.kwargs["num_patches"]` (an int: the request's total
patches, or a list of per-image patch counts) and optionally `kwargs["num_images"]` (default 1, or
the list's length). A request without a usable `num_patches` (another method, a handle call without
the kwarg) gets Ray's default behaviour: power of two random choices, same-node replicas first.

Text requests (`encode_texts(texts, pooling=..., num_tokens=n, num_texts=k)`, `routing.assignment.text_size`)
belong to no image bucket: every replica runs texts in batches of their own, at the text tower's fixed length,
so a text goes to the replica with the shortest queue among those not saturated (then the saturated ones, then
those not ready); its tokens count in this router's in-flight work on that replica as patches do.

What a replica publishes and how it is read: `deployments.routing.stats`. Which replicas own which
buckets: `deployments.routing.assignment` (`assign_buckets`, a pure function).

Spill rule: an owner is saturated when Ray's cached queue length for it is >= `spill_queue_len`
(default: `spill_fraction` x its `max_ongoing_requests`, rounded up, at least 1) or when the patches
this router has in flight on it reach `spill_patches` (default 2 x the largest budget, or 2 x the replicas'
published batch limit where larger; 0 disables;
counts only this router's requests). `choose_replicas` returns ranked groups and Ray picks the
replica with the lowest queue length inside the first group that has one with room
(queue < max_ongoing_requests):

    [owners not saturated, queue < idle_spill_queue_len], [others with an empty queue],
    [owners not saturated], [others not saturated], [owners saturated], [others saturated], [not ready]

preceded by `owner_only_rounds` (default 1) rounds of the first group alone (all unsaturated owners when
no other replica is idle), so that an
owner whose queue length is unknown and whose probe misses Ray's 0.1 s deadline once gets a second
probe (0.2 s) before its requests spill. A selection is counted in Ray's queue-length cache at once
(not when the request is sent), so a burst routed in one go sees its own earlier picks.

The second group is work conservation (`idle_spill_queue_len`, default 2): a replica with nothing to
do takes a request whose owners already have a batch running and one waiting. Measured on one H200
with two replicas and uniform 224x224 traffic, the owner of the small buckets otherwise got 96% of
the requests (88% of the images) while the other replica idled; a replica busy with other sizes is
never idle, so it gets none of them and the size separation holds under mixed load.

Hung replicas (issue 44): a replica whose process stopped (frozen, wedged) keeps its actor and its place in Ray's
replica set, so it would keep getting requests that wait out their deadline. The router shares the process's
`routing.progress.ReplicaProgress` with the ingress that calls through it: it reports which replica each call was
handed to (`on_request_assigned`), probes replicas nothing came back from for a while (`get_queue_len`, every
`stall_timeout_s / 4` at most, in the background), and leaves stalled replicas out of every ranking; with all of
them stalled it offers none (the request waits in Ray's queue; the ingress gives it up at once).

Ray mixins: `ray_compat.SelectionHook` (the selection counted at once, above), `LocalityMixin` for the
fallback path only. `FIFOMixin` is deliberately not used:
it hands a replica found for one request to the oldest pending request, whatever its bucket, which
would undo the affinity. Without it Ray assigns each routing result to the request it was chosen for,
and starts routing requests in arrival order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import weakref
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from ray.serve.request_router import (
    LocalityMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from deployments.ray_compat import SelectionHook, check_ray, queue_len_cache_enabled
from deployments.routing.assignment import assign_buckets, request_size, text_size
from deployments.routing.progress import ReplicaProgress, progress_for
from deployments.routing.stats import BucketRoutingStats, published
from workspace.buckets import BucketError, BucketKey, BucketTable
from workspace.tables import router_fallback_table

logger = logging.getLogger("ray.serve")


# -- router configuration (RequestRouterConfig.request_router_kwargs) -------------------------------------


class BucketRouterConfig(BaseModel):
    """`request_router_kwargs` of the `BucketRouter` (JSON-serialisable; every field optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    buckets: str | list[int] | None = None
    """Table used while no replica publishes one: a `BucketTable.parse` spec; None: the engine default."""
    assignment: Literal["ranges", "rendezvous"] = "ranges"
    spill_fraction: float = Field(default=0.5, gt=0, le=1)
    """Owner saturated at queue length >= ceil(spill_fraction * max_ongoing_requests)."""
    spill_queue_len: int | None = Field(default=None, ge=1)
    """Absolute queue-length threshold; overrides spill_fraction."""
    spill_patches: int | None = Field(default=None, ge=0)
    """Owner saturated when this router has >= this many patches in flight on it; None: 2 x the
    largest budget or 2 x the replicas' published batch limit, the larger; 0: off."""
    idle_spill_queue_len: int | None = Field(default=2, ge=1)
    """Work conservation: when every unsaturated owner has at least this many requests (a batch running
    and one waiting), a non-owner with none at all takes the request before the owners queue it; None:
    off. Uniform traffic (every request in one bucket) then keeps every replica busy, while a non-owner
    busy with other sizes never gets one (it is not idle)."""
    owner_only_rounds: int = Field(default=1, ge=0)
    """Routing rounds that offer only the unsaturated owners before the full ranking. An owner is
    skipped in a round when it has no fresh queue length and its probe misses Ray's deadline (0.1 s,
    doubled every failed round); 0: spill at the first missed probe."""
    num_patches_kwarg: str = "num_patches"
    num_images_kwarg: str = "num_images"
    num_tokens_kwarg: str = "num_tokens"
    num_texts_kwarg: str = "num_texts"

    def default_table(self) -> BucketTable:
        return router_fallback_table() if self.buckets is None else BucketTable.parse(self.buckets)


@dataclass(frozen=True)
class RoutingPlan:
    """Everything `choose_replicas` needs for one replica set; rebuilt when the replicas change."""

    replica_ids: tuple[ReplicaID, ...]  # in candidate order: the cache key
    table: BucketTable
    table_source: Literal["replicas", "config", "default"]
    owners: dict[BucketKey, frozenset[ReplicaID]]
    not_ready: frozenset[ReplicaID]
    max_batch_patches: int = 0  # the largest batch a replica published (0: none did)


# -- the router -------------------------------------------------------------------------------------------


class BucketRouter(SelectionHook, LocalityMixin, RequestRouter):
    """Bucket-affinity routing with queue-length balancing and spill; see the module docstring."""

    def __init__(self, *args, **kwargs):
        check_ray()
        super().__init__(*args, **kwargs)
        self._config = BucketRouterConfig()
        self._fallback_table = self._config.default_table()
        self._plan: RoutingPlan | None = None
        self._warned: set[str] = set()
        # Patches this router has in flight, per replica and per (replica, request); released by a
        # done-callback on the request's result, registered after the increment so it cannot run first.
        self._inflight_patches: defaultdict[ReplicaID, int] = defaultdict(int)
        # keyed by a per-router sequence number, not the request id: concurrent calls made while
        # serving one ingress request can share Serve's internal request id
        self._inflight: dict[tuple[ReplicaID, int], int] = {}
        self._routed_seq = itertools.count()
        # Selections already counted in Ray's queue-length cache but not yet sent (on_replica_selected).
        self._booked: defaultdict[ReplicaID, int] = defaultdict(int)
        # Owner-only routing rounds a pending request has had, by id of its routing context
        self._owner_rounds: dict[int, int] = {}
        self._progress: ReplicaProgress | None = None
        self._prober: asyncio.Task | None = None
        self._probes: dict[str, asyncio.Task] = {}  # replica unique id -> its pending liveness probe

    # -- lifecycle hooks Ray calls ------------------------------------------------------------------

    @staticmethod
    def check_kwargs(kwargs: dict) -> None:
        """`request_router_kwargs` checked where the application is built (`build_app`): Serve calls
        `initialize_state` in each caller's process, where a mistake would only be logged while every request
        waited for a router that never came (the deployment RUNNING, requests 504 at their time limit)."""
        BucketRouterConfig.model_validate(kwargs).default_table()

    def initialize_state(self, **kwargs) -> None:
        """Called by Serve with `RequestRouterConfig.request_router_kwargs`."""
        self._config = BucketRouterConfig.model_validate(kwargs)
        self._fallback_table = self._config.default_table()
        self._plan = None

    @property
    def config(self) -> BucketRouterConfig:
        return self._config

    @property
    def progress(self) -> ReplicaProgress:
        """The process's record of which replicas make progress (`routing.progress`), shared with the ingress."""
        if self._progress is None:
            self._progress = progress_for(self.app_name)
        return self._progress

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self._plan = None  # replica set or their published stats changed
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        uids = {rid.unique_id for rid in live}
        self.progress.set_replicas(uids)
        for uid in [uid for uid in self._probes if uid not in uids]:
            self._probes.pop(uid).cancel()
        self._start_prober()
        for rid in [rid for rid in self._inflight_patches if rid not in live]:
            del self._inflight_patches[rid]
        for key in [key for key in self._inflight if key[0] not in live]:
            del self._inflight[key]
        for rid in [rid for rid in self._booked if rid not in live]:
            del self._booked[rid]

    def on_replica_selected(self, replica: RunningReplica) -> None:
        """Count Ray's pick in its queue-length cache at once (`ray_compat.SelectionHook`).

        Ray bumps its queue-length cache only when the request is sent, after the waiting caller
        resumes; one routing task can route a whole burst of pending requests before that, all
        against the same stale lengths, so the spill threshold would be overshot by the burst. The
        selection is counted here instead, and the bump of the following `on_send_request` skipped.
        """
        if not queue_len_cache_enabled(self):
            return
        cache = self.replica_queue_len_cache
        queue_len = cache.get(replica.replica_id)
        if queue_len is not None:
            cache.update(replica.replica_id, queue_len + 1)
            self._booked[replica.replica_id] += 1

    def on_request_assigned(self, replica: RunningReplica, internal_request_id: str) -> None:
        """Which replica the ingress's call now waits on (`ray_compat.SelectionHook`; `routing.progress`)."""
        self.progress.assigned(internal_request_id, replica.replica_id.unique_id)

    # -- liveness probes (routing.progress) ---------------------------------------------------------------

    def _start_prober(self) -> None:
        """Start the probe loop on the router's event loop, once (Ray may call the hooks outside it first)."""
        if self._prober is not None and not self._prober.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._prober = loop.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            for replica in list(self.curr_replicas.values()):
                uid = replica.replica_id.unique_id
                if uid not in self._probes and self.progress.probe_due(uid):
                    self._probes[uid] = asyncio.create_task(self._probe(replica, uid))
            await asyncio.sleep(min(0.5, self.progress.stall_timeout_s / 6))

    async def _probe(self, replica: RunningReplica, uid: str) -> None:
        """One queue-length call; it waits as long as the replica does (an answer after SIGCONT ends a stall)."""
        progress = self.progress
        progress.probe_sent(uid)
        try:
            await replica.get_queue_len(deadline_s=progress.stall_timeout_s)
        except asyncio.CancelledError:
            progress.probe_failed(uid)
            raise
        except Exception:  # noqa: BLE001 - a dead or unreachable replica: no evidence either way
            progress.probe_failed(uid)
        else:
            progress.probe_answered(uid)
        finally:
            if self._probes.get(uid) is asyncio.current_task():
                del self._probes[uid]

    def progressing(self, candidate_replicas: Sequence[RunningReplica]) -> list[RunningReplica]:
        """The candidates not judged stalled (`routing.progress`)."""
        progress = self.progress
        return [r for r in candidate_replicas if not progress.stalled(r.replica_id.unique_id)]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        booked = self._booked.get(replica_id, 0)
        if booked:  # counted at selection; a booking whose send never came is absorbed here, and
            # the replica's own count (on_new_queue_len_info) overwrites the cache soon after anyway
            if booked == 1:
                del self._booked[replica_id]
            else:
                self._booked[replica_id] = booked - 1
            return
        super().on_send_request(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._plan = None
        super().on_replica_actor_died(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        size = self._size(pending_request) or self._text_size(pending_request)
        if size is None:
            return
        key = (replica_id, next(self._routed_seq))
        self._inflight[key] = size[0]
        self._inflight_patches[replica_id] += size[0]
        loop = asyncio.get_running_loop()  # Ray calls this from its routing coroutine, on the router's loop
        # The result's callbacks fire on a Ray or gRPC thread; hop onto the router's loop.
        result.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, key))

    def _release(self, key: tuple[ReplicaID, int]) -> None:
        patches = self._inflight.pop(key, 0)
        if not patches:
            return
        left = self._inflight_patches.get(key[0], 0) - patches
        if left > 0:
            self._inflight_patches[key[0]] = left
        else:
            self._inflight_patches.pop(key[0], None)

    def inflight_patches(self, replica_id: ReplicaID) -> int:
        """Patches this router sent to the replica that have not completed."""
        return self._inflight_patches.get(replica_id, 0)

    # -- routing --------------------------------------------------------------------------------------

    def _size(self, pending_request: PendingRequest | None) -> tuple[int, int] | None:
        return request_size(pending_request, self._config.num_patches_kwarg, self._config.num_images_kwarg)

    def _text_size(self, pending_request: PendingRequest | None) -> tuple[int, int] | None:
        return text_size(pending_request, self._config.num_tokens_kwarg, self._config.num_texts_kwarg)

    def plan(self, candidate_replicas: Sequence[RunningReplica]) -> RoutingPlan:
        """The (cached) table, owners and readiness for this replica set."""
        key = tuple(r.replica_id for r in candidate_replicas)
        if self._plan is None or self._plan.replica_ids != key:
            self._plan = self._build_plan(candidate_replicas, key)
        return self._plan

    def _build_plan(self, replicas: Sequence[RunningReplica], key: tuple[ReplicaID, ...]) -> RoutingPlan:
        tables: Counter[BucketTable] = Counter()
        not_ready, max_batch = set(), 0
        for replica in sorted(replicas, key=lambda r: r.replica_id.unique_id):
            stats_dict = published(replica)
            if not stats_dict:
                continue
            try:
                stats = BucketRoutingStats.model_validate(stats_dict)
                tables[stats.table()] += 1
            except (ValueError, BucketError) as error:  # pydantic's ValidationError is a ValueError
                self._warn_once(
                    f"stats:{replica.replica_id.unique_id}",
                    f"BucketRouter: ignoring unreadable routing stats of {replica.replica_id}: {error}",
                )
                continue
            if not stats.ready:
                not_ready.add(replica.replica_id)
            max_batch = max(max_batch, stats.max_batch_patches or 0)
        if tables:
            # Most replicas agree (differences only during a rolling update); ties: lowest replica id.
            table, source = tables.most_common(1)[0][0], "replicas"
        else:
            table, source = self._fallback_table, ("default" if self._config.buckets is None else "config")
        by_uid = {r.replica_id.unique_id: r.replica_id for r in replicas}
        owners = assign_buckets(table, by_uid, self._config.assignment)
        return RoutingPlan(
            replica_ids=key,
            table=table,
            table_source=source,
            owners={bucket: frozenset(by_uid[uid] for uid in uids) for bucket, uids in owners.items()},
            not_ready=frozenset(not_ready),
            max_batch_patches=max_batch,
        )

    def bucket_for(self, plan: RoutingPlan, size: tuple[int, int]) -> BucketKey:
        """The request's bucket; sizes above every bucket (run eagerly) count as the largest."""
        return plan.table.bucket_for(*size) or plan.table.largest

    def spill_queue_len(self, replica: RunningReplica) -> int:
        if self._config.spill_queue_len is not None:
            return self._config.spill_queue_len
        return max(1, math.ceil(self._config.spill_fraction * replica.max_ongoing_requests))

    def spill_patches(self, plan: RoutingPlan) -> int:
        """Two full batches in flight on one replica: 2 x its largest bucket, or 2 x its batch limit where that is
        larger (on a CPU one call of 2048 patches filled the 2 x 1024 of its buckets, so every other call spilled)."""
        configured = self._config.spill_patches
        return 2 * max(plan.table.largest.budget, plan.max_batch_patches) if configured is None else configured

    def is_saturated(self, replica: RunningReplica, plan: RoutingPlan) -> bool:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)  # None: unknown, Ray will probe
        if queue_len is not None and queue_len >= self.spill_queue_len(replica):
            return True
        limit = self.spill_patches(plan)
        return bool(limit) and self.inflight_patches(replica.replica_id) >= limit

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._start_prober()
        candidate_replicas = self.progressing(candidate_replicas)
        if not candidate_replicas:
            if pending_request is not None:
                pending_request.routing_context.should_backoff = True
            return []
        size = self._size(pending_request)
        if size is None:
            if self._text_size(pending_request) is not None:
                return self._choose_text(candidate_replicas, pending_request)
            return self._choose_default(candidate_replicas, pending_request)
        plan = self.plan(candidate_replicas)
        owners = plan.owners[self.bucket_for(plan, size)]
        owners_light: list[RunningReplica] = []  # unsaturated, below the idle-spill queue length (or unknown)
        owners_ok: list[RunningReplica] = []  # unsaturated, at or above it
        others_idle: list[RunningReplica] = []  # non-owners known to have no request at all
        others_ok: list[RunningReplica] = []
        owners_busy: list[RunningReplica] = []
        others_busy: list[RunningReplica] = []
        not_ready: list[RunningReplica] = []
        idle_spill = self._config.idle_spill_queue_len
        for replica in candidate_replicas:
            owner = replica.replica_id in owners
            queue_len = self.replica_queue_len_cache.get(replica.replica_id)
            if replica.replica_id in plan.not_ready:
                not_ready.append(replica)
            elif self.is_saturated(replica, plan):
                (owners_busy if owner else others_busy).append(replica)
            elif owner:
                heavy = idle_spill is not None and queue_len is not None and queue_len >= idle_spill
                (owners_ok if heavy else owners_light).append(replica)
            elif idle_spill is not None and queue_len == 0 and not self.inflight_patches(replica.replica_id):
                others_idle.append(replica)  # idle by Ray's cached length and by this router's own requests
            else:
                others_ok.append(replica)
        if pending_request is not None:
            context = pending_request.routing_context
            rounds = self._owner_rounds.get(id(context), 0)
            first = owners_light or (owners_ok if not others_idle else [])
            if first and rounds < self._config.owner_only_rounds:
                # Owners only, and no backoff: Ray retries at once with a doubled probe deadline.
                if not rounds:  # forgotten with the request's routing context
                    weakref.finalize(context, self._owner_rounds.pop, id(context), None)
                self._owner_rounds[id(context)] = rounds + 1
                context.should_backoff = False
                return [first]
            # Every replica is in some group: if none had room, back off before the next round.
            context.should_backoff = True
        groups = (owners_light, others_idle, owners_ok, others_ok, owners_busy, others_busy, not_ready)
        return [group for group in groups if group]

    def _choose_text(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """A text request: no bucket owners; the replicas not saturated first (Ray takes the shortest queue of the
        first group with room), then the saturated ones, then those not ready."""
        plan = self.plan(candidate_replicas)
        ok: list[RunningReplica] = []
        busy: list[RunningReplica] = []
        not_ready: list[RunningReplica] = []
        for replica in candidate_replicas:
            if replica.replica_id in plan.not_ready:
                not_ready.append(replica)
            else:
                (busy if self.is_saturated(replica, plan) else ok).append(replica)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        return [group for group in (ok, busy, not_ready) if group]

    def _choose_default(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Ray's default: two random replicas (same node first when configured); Ray takes the shorter queue."""
        candidates = candidate_replicas
        local_ids = self.apply_locality_routing(pending_request)
        if local_ids:
            preferred = [r for r in candidate_replicas if r.replica_id in local_ids]
            candidates = preferred or candidate_replicas
        elif pending_request is not None:
            pending_request.routing_context.should_backoff = True
        return [random.sample(candidates, min(2, len(candidates)))]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
