"""A discrete-event simulator of an iterserve cluster: many replicas, routers, an autoscaler.

    from iterserve.autoscale.sim.cluster import simulate
    from iterserve.autoscale.sim.policies import IterserveRouter, IterserveAutoscaler
    from iterserve.autoscale.sim.config import ClusterSimConfig
    from iterserve.autoscale.sim.workload import WorkloadRequest

    workload = [WorkloadRequest("r0", arrival_time=0.0, prompt_token_ids=(5,) * 300, max_tokens=64)]
    result = simulate(workload, routers=[IterserveRouter(), IterserveRouter()],
                      num_replicas=8, config=ClusterSimConfig(seed=0),
                      autoscaler=None)          # or IterserveAutoscaler(AutoscaleConfig(...))
    result.summary()        # p50/p99 TTFT, p99 ITL, throughput, preemptions, prefix hits, GPU-h
    result.records          # per request: arrival, routed, first_token, finish, tokens, replica,
                            # router, cached_tokens, preemptions, itl_max, itl_p99
    result.replicas_over_time, result.to_json()   # same seed -> byte-identical JSON

Virtual clock, no Ray, no sleeping. Each replica runs the production `Scheduler` and
`BlockManager` (prefix cache on) with `CostModel` step times (`simulated_replica`).
Routers are any `RoutingPolicy` (one instance per ingress router; request i goes to router
i mod len(routers); routers share nothing but the replicas' published stats, unless
router_sync_delay_s tells each of the others' sends and completions that much later). What the
cluster does to them, as Ray Serve does:
* routing stats: each replica's `ReplicaLoad` is published every routing_stats_period_s
  (its own phase); routers see that, plus their own in-flight corrections and in-flight
  counts (`ReplicaView.correction`, `.ongoing`, as `InFlightTracker` would give them);
  `ReplicaView.cached_prefix_tokens` asks the replica's prefix cache as it is now (the
  real path would answer from the block hashes of its last stats report), and
  `RoutingContext.prefix_cache` gives every replica's answer in one call
  (`sim.prefix.ClusterPrefixCache`: a cluster-wide index of who was sent each
  first block, so most queries cost one lookup, not one per replica);
* max_ongoing_requests: a replica with that many requests in flight is not offered; when
  none is free the request waits at its router and is retried as soon as one frees up;
* autoscaling: replicas push (kv_usage, num_waiting, num_running) every
  metrics_push_interval_s; every autoscale_interval_s the policy sees each running replica's
  mean over look_back_period_s and the requests queued at routers;
* a new replica serves startup_delay_s after the decision (paid for from the decision); a
  removed one leaves the routers at once, drains its requests, then stops;
* zero replicas: requests wait at their routers; scaling from zero is the policy's rule
  (`decide` asks for one replica when requests wait and none runs, as Serve's controller
  does), not the simulator's; `IterserveAutoscaler` applies Serve's own scale-down rules
  (`ServeScaleDown`: to 1 first, 1 -> 0 after downscale_to_zero_delay_s).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Hashable, Sequence

from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.cluster_controller import (
    ARRIVE,
    PEER_COMPLETED,
    PEER_ROUTED,
    POLL,
    PULL_LANDED,
    PULL_READ,
    PUSH,
    READY,
    TICK,
    WAKE,
    ServeController,
)
from iterserve.autoscale.sim.cluster_pulls import KVPullEvents
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.gateway_flow_control import FlowControlGate
from iterserve.autoscale.sim.ingress_gate import IngressGate
from iterserve.autoscale.sim.itl import ItlCounter
from iterserve.autoscale.sim.kv_pull import KVPulls
from iterserve.autoscale.sim.kv_tiers import tier_tokens
from iterserve.autoscale.sim.lora import adapter_loads, adapter_readers
from iterserve.autoscale.sim.prefix import ClusterPrefixCache, PromptBlockKeys
from iterserve.autoscale.sim.prompts import PackedPrefixes
from iterserve.autoscale.sim.results import RequestRecord, SimResult
from iterserve.autoscale.sim.routing_context import (
    AutoscalingPolicy,
    OfferDelta,
    PeerSyncedPolicy,
    ReplicaView,
    RouteRequest,
    RoutingContext,
    RoutingPolicy,
)
from iterserve.autoscale.sim.simulated_replica import SimulatedReplica
from iterserve.autoscale.sim.state import (
    DRAINING,
    RUNNING,
    STARTING,
    STOPPED,
    ReplicaSlot,
    RouterState,
    cyclic_gc_paused,
)
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.errors import SLOUnreachableError
from iterserve.replica.request import Request


class ClusterSim(ServeController, KVPullEvents):
    """One run; use `simulate`."""

    def __init__(self, workload: Sequence[WorkloadRequest], routers: Sequence[RoutingPolicy],
                 num_replicas: int, config: ClusterSimConfig,
                 autoscaler: AutoscalingPolicy | None) -> None:
        if not routers:
            raise ValueError("need at least one router")
        if num_replicas < (0 if autoscaler is not None else 1):
            raise ValueError(f"need at least one replica (none only with an autoscaler), got "
                             f"{num_replicas}")
        if config.router_sync_delay_s is not None and not all(
                isinstance(p, PeerSyncedPolicy) for p in routers):
            raise ValueError("router_sync_delay_s needs routers that hear their peers' sends "
                             "(PeerSyncedPolicy)")
        tenancy = config.tenancy
        if tenancy is not None and tenancy.slo_admission and config.kv_pulls is not None:
            raise ValueError("SLO admission with KV pulls is not modelled")
        self.config = config
        # requests held in front of the routers while the pool is saturated: llm-d-style
        # flow control (sim/gateway_flow_control.py) or the ingress queue (sim/ingress_gate.py)
        self.gate: FlowControlGate | IngressGate | None = None
        if tenancy is not None and tenancy.gateway is not None:
            self.gate = FlowControlGate(tenancy, tenancy.gateway)
        elif tenancy is not None and tenancy.ingress is not None:
            self.gate = IngressGate(tenancy, tenancy.ingress)
        self.rng = random.Random(config.seed)
        self.routers = [RouterState(i, p, random.Random(f"{config.seed}/router/{i}"))
                        for i, p in enumerate(routers)]
        self.autoscaler = autoscaler
        self.workload = sorted(workload, key=lambda r: r.arrival_time)
        self.records = {s.request_id: RequestRecord(
            s.request_id, s.arrival_time, len(s.prompt_token_ids), s.max_tokens,
            router=i % len(routers)) for i, s in enumerate(self.workload)}
        if len(self.records) != len(self.workload):
            raise ValueError("request ids must be unique")
        self.specs = {s.request_id: s for s in self.workload}
        self.slots: list[ReplicaSlot] = []
        self._slot_by_id: dict[str, ReplicaSlot] = {}
        self._free: list[ReplicaSlot] | None = None  # running slots with room (None: stale)
        self._free_ids: list[str] = []  # their replica ids, when _free is not None
        self._free_position: dict[str, int] = {}  # replica id -> its place in _free_ids
        self.prompt_keys = PromptBlockKeys(config.block_size)
        self.prefix_cache = ClusterPrefixCache(self.prompt_keys)
        self._prefix_tiers = self.prefix_cache.tiers if config.kv_tiers is not None else None
        self.packed_prefixes = PackedPrefixes()
        self.pulls = None if config.kv_pulls is None else KVPulls(
            config.kv_pulls, config.sim.cost, config.sim.kv_bytes_per_token, config.block_size)
        self.published: dict[str, ReplicaLoad] = {}
        self.itl = ItlCounter()
        self.replicas_over_time: list[tuple[float, int, int, int]] = []
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.target = num_replicas
        self.num_open = len(self.workload)  # requests neither finished nor rejected
        self._freed = False
        for _ in range(num_replicas):
            self._start_slot(ready_at=0.0)
        self._next_arrival = 0  # arrivals are read in order, not heaped (the heap stays small)
        if autoscaler is not None:
            self._push(config.autoscale_interval_s, TICK, None)

    # ---------------------------------------------------------------------- events
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def run(self, progress: Callable[[float], None] | None = None,
            progress_every_s: float = 10.0) -> SimResult:
        """progress(t): called at the first event at or after every progress_every_s
        virtual seconds (a long run's heartbeat; it must not touch the simulation)."""
        next_report = progress_every_s if progress is not None else math.inf
        handlers = {ARRIVE: self._on_arrive, WAKE: self._on_wake, POLL: self._on_poll,
                    PUSH: self._on_push, TICK: self._on_tick, READY: self._on_ready,
                    PEER_ROUTED: self._on_peer_routed, PEER_COMPLETED: self._on_peer_completed,
                    PULL_READ: self._on_pull_read, PULL_LANDED: self._on_pull_landed}
        workload, events = self.workload, self.events
        num_routers = len(self.routers)
        while self.num_open > 0:
            i = self._next_arrival
            if i < len(workload) and (not events or workload[i].arrival_time <= events[0][0]):
                t, kind, payload = workload[i].arrival_time, ARRIVE, (i % num_routers,
                                                                      workload[i])
                self._next_arrival = i + 1
            elif events:
                t, _, kind, payload = heapq.heappop(events)
            else:
                break
            if t > self.config.max_virtual_s:
                break
            if t >= next_report:
                progress(t)
                next_report = t + progress_every_s
            self.now = t
            handlers[kind](payload)
            if self._freed:  # a request finished: one waiting at a router may go now
                self._freed = False
                self._retry_queued()
                if self.gate is not None and len(self.gate):
                    self._release_gate()
        return self._result()

    def _on_arrive(self, payload: object) -> None:
        router_index, spec = payload
        if self.gate is not None:
            if len(self.gate) or self._pool_saturated():
                self.gate.hold(router_index, spec)
                return
            self.gate.dispatched(spec)
            if self.gate.watches_steps:
                self._free = None
        self._route(router_index, spec)

    def _route(self, router_index: int, spec: WorkloadRequest) -> None:
        router = self.routers[router_index]
        if router.queue or not self._dispatch(router, spec):
            router.queue.append(spec)

    def _pool_saturated(self) -> bool:
        return not self.gate.pool_has_room(self.slots)

    def _release_gate(self) -> None:
        """Held requests go, in the gate's order, while the pool has room."""
        while len(self.gate) and not self._pool_saturated():
            if self.gate.watches_steps:
                self._free = None  # each send changes which replicas it offers
            self._route(*self.gate.release())

    def _on_wake(self, slot: ReplicaSlot) -> None:
        if slot.wake_at != self.now or slot.replica is None:
            return  # superseded by a later reschedule
        slot.wake_at = None
        self._touch(slot)
        self._schedule_wake(slot)
        if self.gate is not None and self.gate.watches_steps and len(self.gate):
            self._release_gate()  # the step's prefill made room

    def _on_poll(self, slot: ReplicaSlot) -> None:
        if slot.state not in (RUNNING, DRAINING):
            return
        self._touch(slot)
        self.published[slot.replica_id] = slot.replica.load(self.now)
        for router in self.routers:
            router.stats_published(slot.replica_id)
        self._schedule_wake(slot)
        self._push(self.now + self.config.routing_stats_period_s, POLL, slot)
        if self.gate is not None and len(self.gate):  # its new stats may show room
            self._release_gate()

    def _on_push(self, slot: ReplicaSlot) -> None:
        if slot.state != RUNNING:
            return
        self._touch(slot)
        load = slot.replica.load(self.now)
        slot.samples.append((self.now, load.kv_usage, load.num_waiting, load.num_running))
        horizon = self.now - self.config.look_back_period_s
        while slot.samples and slot.samples[0][0] <= horizon:
            slot.samples.popleft()
        self._schedule_wake(slot)
        self._push(self.now + self.config.metrics_push_interval_s, PUSH, slot)

    def _on_ready(self, slot: ReplicaSlot) -> None:
        if slot.state != STARTING:
            return  # cancelled while starting
        slot.state = RUNNING
        self._free = None
        slot.replica = SimulatedReplica(slot.replica_id, self.config, self.now, self.prompt_keys,
                                  self.packed_prefixes)
        if self.config.enable_prefix_caching:
            bm = slot.replica.block_manager
            lower = [t for t in (bm.host, bm.sim_disk.index if bm.sim_disk else None) if t is not None]
            self.prefix_cache.add_replica(slot.replica_id, bm.cached_blocks, lower)
        phase = self.rng.uniform(0.0, self.config.routing_stats_period_s)
        self._push(self.now + phase, POLL, slot)
        if self.autoscaler is not None:
            self._push(self.now + phase, PUSH, slot)
        self._replicas_changed()
        self._freed = True

    # --------------------------------------------------------------------- routing
    def _dispatch(self, router: RouterState, spec: WorkloadRequest) -> bool:
        """Route one request now; False if every replica is at max_ongoing_requests."""
        limit = self.config.max_ongoing_requests
        free = self._free
        if free is None:  # recomputed only after a slot's state or room changed
            gate = self.gate
            free = self._free = [s for s in self.slots if s.state == RUNNING
                                 and s.ongoing < limit and (gate is None or gate.offers(s))]
            self._free_ids = [s.replica_id for s in free]
            self._free_position = {rid: i for i, rid in enumerate(self._free_ids)}
        if not free:
            return False
        changed: list[int] = []
        if router.offered_for is not self._free_ids:  # other replicas are free: all anew
            router.offered = [router.views.get(s.replica_id) or self._view(router, s)
                              for s in free]  # a new list: a new token for the policy
            router.offered_for = self._free_ids
        else:  # the same ones: only the views dropped since this router's last request
            position = self._free_position
            for rid in router.changed:
                i = position.get(rid)
                if i is not None:
                    router.offered[i] = self._view(router, free[i])
                    changed.append(i)
        router.changed.clear()
        views = router.offered.copy()
        route = RouteRequest(spec.request_id, spec.prompt_token_ids, spec.max_tokens,
                             spec.arrival_time, spec.session_id, spec.adapter)
        ctx = RoutingContext(route, views, self.now, self.config.block_size, self.prefix_cache,
                             OfferDelta(router.offered, changed), self._prefix_tiers)
        chosen = router.policy.choose(ctx, router.rng)
        slot = self._slot_by_id.get(chosen)
        if slot is None or slot.state != RUNNING or slot.ongoing >= limit:  # not offered
            raise ValueError(f"router {router.policy.name!r} chose {chosen!r}, not one of "
                             "the replicas it was offered")
        record = self.records[spec.request_id]
        self._touch(slot)
        sync = self.config.router_sync_delay_s
        if sync is not None:  # what the replica must prefill, as its peers will hear it
            prefill = len(spec.prompt_token_ids) - slot.replica.cached_prefix_tokens(
                spec.prompt_token_ids)
        pull = self._plan_pull(spec, slot) if self.pulls is not None else None
        if pull is not None:  # it reaches the replica once the blocks have (sim/kv_pull.py)
            self._push(self.now + self.config.kv_pulls.pull_latency_s, PULL_READ, pull)
        else:
            try:
                slot.replica.add(spec, self.now)
            except SLOUnreachableError:  # refused at once (a 429): its client has the answer
                record.rejected, record.routed, record.replica = True, self.now, slot.replica_id
                self.num_open -= 1
                return True
            except ValueError:  # can never fit this replica: rejected, as the engine would
                self.num_open -= 1
                return True
        record.routed, record.replica = self.now, slot.replica_id
        self.prefix_cache.routed(slot.replica_id, spec.prompt_token_ids, spec.max_tokens,
                                 spec.output_token_id)
        slot.ongoing += 1
        if slot.ongoing == limit:
            self._free = None
        router.routed(slot.replica_id, spec.request_id, len(spec.prompt_token_ids)
                      + spec.max_tokens)
        router.policy.on_routed(route, slot.replica_id, self.now)
        if sync is not None:
            self._push(self.now + sync, PEER_ROUTED,
                       (router.index, route, slot.replica_id, self.now, prefill))
        self._schedule_wake(slot)
        return True

    def _on_peer_routed(self, payload: object) -> None:
        origin, route, replica_id, sent_at, prefill = payload
        for router in self.routers:
            if router.index != origin:
                router.policy.on_peer_routed(route, replica_id, sent_at, prefill, self.now)

    def _on_peer_completed(self, payload: object) -> None:
        origin, request_id, replica_id = payload
        for router in self.routers:
            if router.index != origin:
                router.policy.on_completed(request_id, replica_id, self.now)

    def _view(self, router: RouterState, slot: ReplicaSlot) -> ReplicaView:
        rid = slot.replica_id
        view = ReplicaView(rid, self.published.get(rid), router.correction(rid),
                           router.ongoing.get(rid, 0), slot.replica.cached_prefix_tokens)
        router.views[rid] = view
        return view

    def _retry_queued(self) -> None:
        for router in self.routers:
            while router.queue and self._dispatch(router, router.queue[0]):
                router.queue.popleft()

    def _replicas_changed(self) -> None:
        live: list[Hashable] = [s.replica_id for s in self.slots if s.state == RUNNING]
        for router in self.routers:
            router.policy.on_replicas_changed(live)
        self._record_counts()

    def _record_counts(self) -> None:
        counts = (self.now, self._count(RUNNING), self._count(STARTING), self._count(DRAINING))
        if not self.replicas_over_time or self.replicas_over_time[-1] != counts:
            self.replicas_over_time.append(counts)

    def _count(self, state: str) -> int:
        return sum(1 for s in self.slots if s.state == state)

    # -------------------------------------------------------------------- replicas
    def _touch(self, slot: ReplicaSlot) -> None:
        """Bring a replica up to now and hand back what finished."""
        replica = slot.replica
        replica.advance(self.now)
        if replica.finished:
            finished, replica.finished = replica.finished, []
            for request in finished:
                self._complete(slot, request)
            if slot.state == DRAINING and slot.ongoing == 0:
                self._stop(slot)
            self._freed = True

    def _schedule_wake(self, slot: ReplicaSlot) -> None:
        wake = slot.replica.wake_time
        if wake is not None and wake != slot.wake_at:
            slot.wake_at = wake
            self._push(wake, WAKE, slot)

    def _complete(self, slot: ReplicaSlot, request: Request) -> None:
        record = self.records[request.request_id]
        spec = self.specs[request.request_id]
        # The Ray path's latency outside the replica: a shift of the client-side times.
        outside = self.config.dispatch_latency_s + self.config.stream_latency_s
        record.first_token = request.first_token_time + outside
        record.finish = request.finished_time + outside
        record.output_tokens = request.num_output_tokens
        record.cached_tokens = request.num_cached_tokens
        record.preemptions = request.num_preemptions
        self.itl.add(request.token_times, record)  # its itl_max, itl_p99: set by a batch
        slot.ongoing -= 1
        if slot.ongoing == self.config.max_ongoing_requests - 1:
            self._free = None
        self.num_open -= 1
        if self.gate is not None:
            self.gate.completed(spec, request.num_output_tokens)
        router = self.routers[record.router]
        router.completed(slot.replica_id, request.request_id,
                         len(spec.prompt_token_ids) + spec.max_tokens)
        router.policy.on_completed(request.request_id, slot.replica_id, self.now)
        if self.config.router_sync_delay_s is not None:
            self._push(self.now + self.config.router_sync_delay_s, PEER_COMPLETED,
                       (record.router, request.request_id, slot.replica_id))

    def _start_slot(self, ready_at: float) -> ReplicaSlot:
        slot = ReplicaSlot(f"replica-{len(self.slots)}", created_at=self.now)
        self.slots.append(slot)
        self._slot_by_id[slot.replica_id] = slot
        if ready_at <= self.now:
            self._on_ready(slot)
        else:
            self._push(ready_at, READY, slot)
        return slot

    def _stop(self, slot: ReplicaSlot) -> None:
        slot.state = STOPPED
        self._free = None
        slot.stopped_at = self.now
        # No router asks a stopped replica (answers are for candidates only): drop its cache
        # so a long autoscaled run does not hold every stopped replica's prefix cache.
        self.prefix_cache.remove_replica(slot.replica_id)
        self._record_counts()

    # ----------------------------------------------------------------------- result
    def _result(self) -> SimResult:
        self.itl.flush()  # the records' itl_max / itl_p99 of the last batch
        end = self.now
        engines = [s.replica for s in self.slots if s.replica is not None]
        return SimResult(
            records=[self.records[s.request_id] for s in self.workload],
            replicas_over_time=self.replicas_over_time,
            gpu_seconds=sum((s.stopped_at if s.stopped_at is not None else end) - s.created_at
                            for s in self.slots),
            end_time=end,
            prefix_query_tokens=sum(e.block_manager.prefix_queries for e in engines),
            prefix_hit_tokens=sum(e.block_manager.prefix_hits for e in engines),
            tier_tokens=tier_tokens(engines) if self.config.kv_tiers is not None else {},
            itl_counts=self.itl.histogram(),
            adapter_loads=adapter_loads(e.adapters for e in engines if e.adapters is not None)
            if self.config.lora is not None else {},
            adapter_readers=adapter_readers(e.adapters for e in engines if e.adapters is not None),
            num_steps=sum(e.num_steps for e in engines),
            kv_pulls=self.pulls.summary() if self.pulls is not None else {},
            router_names=[r.policy.name for r in self.routers],
            autoscaler_name=None if self.autoscaler is None else self.autoscaler.name,
        )


def simulate(workload: Sequence[WorkloadRequest], routers: Sequence[RoutingPolicy],
             num_replicas: int = 1, config: ClusterSimConfig | None = None,
             autoscaler: AutoscalingPolicy | None = None,
             progress: Callable[[float], None] | None = None) -> SimResult:
    """Run the workload through the cluster until every request finishes (see module doc).

    num_replicas: replicas ready at t=0 (the autoscaler's starting target; 0, with an
    autoscaler, starts from zero: the first requests wait for the replica its policy must ask
    for, as on Serve; a policy that leaves them waiting with none is a ValueError). routers: one
    policy object per ingress router, fresh for each run (they keep state). progress:
    called with the virtual time every 10 virtual seconds (see ClusterSim.run).
    """
    with cyclic_gc_paused():
        return ClusterSim(workload, routers, num_replicas, config or ClusterSimConfig(),
                          autoscaler).run(progress)
