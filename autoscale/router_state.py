"""The state and calls of iterserve's router, shared by the Ray adapter and the simulator.

`KVRouterCore` owns one router's prefix-affinity table, in-flight tracker and routed-work
meter, and ranks with them: router_policy's score, computed by its `ScoreTable`
(per-replica terms kept between requests; `router_table`). `autoscale/router.py` (Ray
Serve's `RequestRouter`) and `autoscale/sim/iterserve_router.py` (the `RoutingPolicy` the
cluster simulator and the tournament run) both delegate to it, so both run the same code on
the same state.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic

import numpy as np

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_meters import RoutedWorkMeter
from iterserve.autoscale.router_policy import (
    Correction,
    InFlightTracker,
    PrefixAffinityTable,
    R,
    prefix_hash,
)
from iterserve.autoscale.router_table import OfferedRows, ScoreTable
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.replica.block_keys import CacheNamespace


class KVRouterCore(Generic[R]):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.affinity: PrefixAffinityTable[R] = PrefixAffinityTable(config.prefix_max_entries)
        self.in_flight: InFlightTracker[R] = InFlightTracker(config.drain_inflight_prefill,
                                                             config.drain_inflight_waiting)
        self.routed_work: RoutedWorkMeter[R] = RoutedWorkMeter(config.routed_work_half_life_s)
        self.table: ScoreTable[R] = ScoreTable(config)
        self.in_flight.on_change = self.table.invalidate
        # The routed-work slots of the last offer asked about, and the meter's slot version
        self._offer_slots: tuple[OfferedRows[R], int, np.ndarray] | None = None

    def request_key(self, token_ids: Sequence[int] | None, max_tokens: int,
                    namespace: CacheNamespace = b"") -> tuple[int | None, int]:
        """(prefix-affinity key or None, KV footprint: prompt + max_tokens, or 0). The key
        is the prompt's in its cache namespace (a tenant's salt): another namespace's equal
        prompt has another key, as its cached blocks are others."""
        if not token_ids:
            return None, 0
        key = None
        if self.config.prefix_affinity:
            key = prefix_hash(token_ids, self.config.prefix_block_size,
                              self.config.prefix_num_blocks)
            if key is not None and namespace:
                key = hash((namespace, key))
        return key, len(token_ids) + max_tokens

    def rank(self, candidates: Sequence[R], loads: Sequence[ReplicaLoad | None],
             key: int | None, num_tokens: int, now: float, prompt_tokens: int = 0,
             cached_tokens: Mapping[R, int] | None = None,
             corrections: Sequence[Correction | None] | None = None) -> list[R]:
        """Candidates best first by router_policy's score with this router's state (computed
        by its `ScoreTable`). loads[i]: candidates[i]'s last stats (None: none yet).
        cached_tokens: the replicas' own prefix-cache answers for this prompt (missing: 0),
        if known. corrections[i]: candidates[i]'s in-flight correction from elsewhere
        (None: this router's tracker)."""
        return self._decide(candidates, loads, key, num_tokens, now, prompt_tokens,
                            cached_tokens, corrections, full=True)

    def best(self, candidates: Sequence[R], loads: Sequence[ReplicaLoad | None],
             key: int | None, num_tokens: int, now: float, prompt_tokens: int = 0,
             cached_tokens: Mapping[R, int] | None = None,
             corrections: Sequence[Correction | None] | None = None) -> R:
        """`rank(...)[0]` without ordering the rest."""
        return self._decide(candidates, loads, key, num_tokens, now, prompt_tokens,
                            cached_tokens, corrections, full=False)[0]

    def _decide(self, candidates: Sequence[R], loads: Sequence[ReplicaLoad | None],
                key: int | None, num_tokens: int, now: float, prompt_tokens: int,
                cached_tokens: Mapping[R, int] | None,
                corrections: Sequence[Correction | None] | None, full: bool) -> list[R]:
        if len(loads) != len(candidates) or (corrections is not None
                                             and len(corrections) != len(candidates)):
            raise ValueError("loads and corrections must be aligned with the candidates")
        table = self.table
        rows = table.rows_for(candidates)
        table.refresh(candidates, rows, loads, corrections, self.in_flight.correction)
        affinity = self.affinity.as_mapping()
        pending = affinity.get(key) if affinity and key is not None else None
        work = None
        if self.config.routed_work_weight and len(self.routed_work):
            work = self.routed_work.values(candidates, now)
        return table.decide(candidates, rows, now, num_tokens, prompt_tokens,
                            cached_tokens, work, pending, full)

    def offer(self, candidates: Sequence[R]) -> OfferedRows[R]:
        """The candidates as a list the caller will offer again (see `best_offered`)."""
        return self.table.offer(candidates)

    def best_offered(self, offered: OfferedRows[R], order: Sequence[int],
                     changed: Iterable[int], load_at: Callable[[int], ReplicaLoad | None],
                     key: int | None, num_tokens: int, now: float, prompt_tokens: int = 0,
                     cached_tokens: Mapping[R, int] | None = None) -> R:
        """`best` with this router's own tracker for the candidates `offered.ids[j] for j
        in order` (order: a permutation of the offer's positions; it only breaks ties), whose
        loads are `load_at(i)` for position i and differ from the last call with this offer
        only at the `changed` positions: the per-candidate work is done for those alone."""
        table = self.table
        table.refresh_offered(offered, changed, load_at, self.in_flight.correction)
        affinity = self.affinity.as_mapping()
        pending = affinity.get(key) if affinity and key is not None else None
        work = None
        if self.config.routed_work_weight and len(self.routed_work):
            work = self._offered_work(offered, now)
        return table.best_offered(offered, order, now, num_tokens, prompt_tokens,
                                  cached_tokens, work, pending)

    def _offered_work(self, offered: OfferedRows[R], now: float) -> Sequence[float]:
        meter, ids = self.routed_work, offered.ids
        if len(ids) < meter.ARRAYS_FROM:
            return meter.values(ids, now)
        slots = self._offer_slots
        if slots is None or slots[0] is not offered or slots[1] != meter.slots_version:
            slots = self._offer_slots = (offered, meter.slots_version, meter.slots(ids))
        return meter.values_at(slots[2], now)

    def routed(self, request_id: str, replica_id: R, now: float, key: int | None,
               num_tokens: int, prefill_tokens: int = 0) -> None:
        """prefill_tokens: the prompt tokens the chosen replica must compute (uncached)."""
        self.in_flight.routed(request_id, replica_id, now, prompt_tokens=num_tokens,
                              prefill_tokens=prefill_tokens)
        self.routed_work.add(replica_id, prefill_tokens, now)
        self.affinity.record(key, replica_id)

    def peer_routed(self, request_id: str, replica_id: R, sent_at: float, num_tokens: int,
                    prefill_tokens: int) -> None:
        """Another router's send: in flight as if this router had sent it at `sent_at` (so
        a replica's stats taken since count it as seen), but not in the affinity table
        (the replicas' own cache reports say where prefixes are) nor in the routed-work
        meter (each router balances its own sends; counting the peers' too doubles the
        balance term: multi-turn p99 1.2x in the tournament cells)."""
        self.in_flight.routed(request_id, replica_id, sent_at, prompt_tokens=num_tokens,
                              prefill_tokens=prefill_tokens)

    def completed(self, request_id: str) -> None:
        self.in_flight.completed(request_id)

    def keep_only(self, live: Iterable[Hashable]) -> None:
        """Forget the affinity of replicas that left (their in-flight entries complete)."""
        live_ids = set(live)
        for rid in {r for r in self.affinity.as_mapping().values() if r not in live_ids}:
            self.affinity.forget_replica(rid)
        for rid in [r for r in self.routed_work.snapshot(0.0) if r not in live_ids]:
            self.routed_work.forget_replica(rid)

    def replica_died(self, replica_id: R) -> None:
        self.affinity.forget_replica(replica_id)
        self.in_flight.forget_replica(replica_id)
        self.routed_work.forget_replica(replica_id)
