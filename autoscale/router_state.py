"""The state and calls of iterserve's router, shared by the Ray adapter and the simulator.

`KVRouterCore` owns one router's prefix-affinity table and in-flight tracker and calls
`rank_replicas` with them. `autoscale/router.py` (Ray Serve's `RequestRouter`) and
`autoscale/iterserve_routing.py` (the `RoutingPolicy` the cluster simulator and the
tournament run) both delegate to it, so both run the same code on the same state.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Generic

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_meters import RoutedWorkMeter
from iterserve.autoscale.router_policy import (
    Correction,
    InFlightTracker,
    PrefixAffinityTable,
    R,
    prefix_hash,
    rank_replicas,
)
from iterserve.autoscale.signals import ReplicaLoad


class KVRouterCore(Generic[R]):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.affinity: PrefixAffinityTable[R] = PrefixAffinityTable(config.prefix_max_entries)
        self.in_flight: InFlightTracker[R] = InFlightTracker()
        self.routed_work: RoutedWorkMeter[R] = RoutedWorkMeter(config.routed_work_half_life_s)

    def request_key(self, token_ids: Sequence[int] | None, max_tokens: int
                    ) -> tuple[int | None, int]:
        """(prefix-affinity key or None, KV footprint: prompt + max_tokens, or 0)."""
        if not token_ids:
            return None, 0
        key = None
        if self.config.prefix_affinity:
            key = prefix_hash(token_ids, self.config.prefix_block_size,
                              self.config.prefix_num_blocks)
        return key, len(token_ids) + max_tokens

    def rank(self, candidates: Sequence[R], loads: Mapping[R, ReplicaLoad | None],
             key: int | None, num_tokens: int, now: float, prompt_tokens: int = 0,
             cached_tokens: Mapping[R, int] | None = None,
             corrections: Mapping[R, Correction] | None = None) -> list[R]:
        """Candidates best first (`rank_replicas` with this router's state).
        cached_tokens: the replicas' own prefix-cache answers for this prompt, if known.
        corrections: in-flight corrections from elsewhere (None: this router's tracker)."""
        if corrections is None:
            corrections = self.in_flight.corrections(loads)
        return rank_replicas(
            candidates=candidates,
            loads=loads,
            in_flight_corrections=corrections,
            config=self.config,
            prompt_prefix_hash=key,
            affinity=self.affinity.as_mapping(),
            now=now,
            request_tokens=num_tokens,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            routed_work=self.routed_work.snapshot(now) if self.config.routed_work_weight else None,
        )

    def routed(self, request_id: str, replica_id: R, now: float, key: int | None,
               num_tokens: int, prefill_tokens: int = 0) -> None:
        """prefill_tokens: the prompt tokens the chosen replica must compute (uncached)."""
        self.in_flight.routed(request_id, replica_id, now, prompt_tokens=num_tokens,
                              prefill_tokens=prefill_tokens)
        self.routed_work.add(replica_id, prefill_tokens, now)
        self.affinity.record(key, replica_id)

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
