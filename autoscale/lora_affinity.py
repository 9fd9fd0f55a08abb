"""LoRA adapter affinity: send a request for an adapter where the adapter is already held.

A replica that does not hold a request's adapter reads it from disk first (milliseconds to
seconds, before the request's prefill), and one whose `max_loras` adapter slots all serve
running requests makes a request for another adapter wait until one of them has no request
left (the engine's admission rule): under a steady mix that wait has no bound. So, as the
Gateway API inference extension's lora-affinity scorer does, the router prefers a replica
running the adapter, then one holding it (`ReplicaLoad.lora_adapters`) with a slot free for
it, then any with a slot free (which reads it), under a load guard: only replicas waiting
at most `lora_affinity_slack` requests more than the least waiting one. An adapter whose
share of the router's recent requests needs more replicas than hold it (lora_traffic.py:
its rate per holder above a replica's share of the cluster's rate) spreads to a replica
that does not hold it yet, before its holders' queues grow; one that does not keeps to its
holders. Beyond the slack, load wins and a replica near the floor reads the adapter anyway:
the guard for a share the estimate has not caught up with (an adapter turning hot), so an
adapter never queues without bound on the replicas that held it first (the pinning Ray
Serve's multiplexing shows, ray#65691).

The guard is measured from the least waiting replica, not from the score's leader: the
score's routed-work balance assumes replicas of equal speed, and a replica slowed by adapter
loads and slot waits gets the least routed work, so it stays the leader while its queue
grows; measured from it, a slack admits every holder however far behind (the tournament's
8-replica LoRA cells: 15 s p99 TTFT, loadtests/studies/router_tournament/README.md). Pure
functions: the Ray router (router.py) and the simulator's call them after ranking.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.lora_traffic import needs_another_holder
from iterserve.autoscale.router_inflight import Correction
from iterserve.autoscale.router_policy import effective_load
from iterserve.autoscale.signals import ReplicaLoad

R = TypeVar("R")
LORA_REQUEST_ARG = 4  # deploy's generate(ids, params, request_id, priority, lora_request)


def request_adapter(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The adapter a handle call names: kwargs["lora_request"] or the positional argument,
    an object with a `name` (replica/lora_adapter.LoRARequest); None for the base model."""
    lora = kwargs.get("lora_request")
    if lora is None and len(args) > LORA_REQUEST_ARG:
        lora = args[LORA_REQUEST_ARG]
    name = getattr(lora, "name", None)
    return name if isinstance(name, str) else None


def prefer_adapter_holders(ranked: Sequence[R], loads: Mapping[R, ReplicaLoad | None],
                           waiting: Mapping[R, int], adapter: str | None, slack: float,
                           traffic_share: float) -> list[R]:
    """`ranked` (best first) with the replica for `adapter`'s request moved to the front.

    waiting: each replica's waiting requests as the router counts them (its last stats plus
    the requests sent since). traffic_share: the adapter's share of the router's recent
    requests (lora_traffic.AdapterTraffic.share). Only replicas not draining that wait at most
    `slack` more than the least waiting one are taken. If the adapter needs another holder
    for its share (`needs_another_holder`, counting every live replica holding or running
    it), the one holding the fewest adapters (ties: the ranking) among those with a slot free
    that do not hold it. Else (or where there is none), the least waiting (ties: the ranking)
    of the first group that is not empty: those running the adapter, those holding it with
    a slot free for it; else the one holding the fewest adapters among those with a slot
    free, or among all of them.

    Where the adapter is read from disk, the replica holding the fewest adapters is where
    that costs least. The best ranked, taken before, received a cold adapter wherever the
    score led at that moment, so every replica came to hold and run a mixed set: cold
    adapters read on several replicas and device slots thrashing (the tournament's LoRA
    cells: 5-35 % more loads than Ray's multiplexing, whose rule for a model no replica
    holds is this one)."""
    order = list(ranked)
    if adapter is None or not order:
        return order
    live = [r for r in order if not _draining(loads.get(r))] or order
    floor = min(waiting.get(r, 0) for r in live)
    near = [r for r in live if waiting.get(r, 0) <= floor + slack]
    with_slot = [r for r in near if _has_slot_for(loads.get(r), adapter)]
    holder_count = sum(1 for r in live if _holds_or_runs(loads.get(r), adapter))
    spreading = needs_another_holder(traffic_share, holder_count, len(live))
    newcomers = [r for r in with_slot if spreading
                 and not _holds_or_runs(loads.get(r), adapter)]
    running = [r for r in with_slot if _runs(loads.get(r), adapter)]
    holders = [r for r in with_slot if _holds(loads.get(r), adapter)]
    if newcomers:
        first = min(newcomers, key=lambda r: _held_count(loads.get(r)))
    elif running or holders:
        first = min(running or holders, key=lambda r: waiting.get(r, 0))
    else:
        first = min(with_slot or near, key=lambda r: _held_count(loads.get(r)))
    return [first, *(r for r in order if r != first)]


def _draining(load: ReplicaLoad | None) -> bool:
    return load is not None and load.draining


def _has_slot_for(load: ReplicaLoad | None, adapter: str) -> bool:
    return load is None or load.has_slot_for(adapter)


def _held_count(load: ReplicaLoad | None) -> int:
    return 0 if load is None else len(load.lora_adapters)


def _runs(load: ReplicaLoad | None, adapter: str) -> bool:
    return load is not None and adapter in load.lora_running


def _holds_or_runs(load: ReplicaLoad | None, adapter: str) -> bool:
    return _holds(load, adapter) or _runs(load, adapter)


def _holds(load: ReplicaLoad | None, adapter: str) -> bool:
    return load is not None and adapter in load.lora_adapters


def waiting_counts(ids: Sequence[R], loads: Sequence[ReplicaLoad | None],
                   corrections: Sequence[Correction | None], now: float, config: RouterConfig
                   ) -> dict[R, int]:
    """Each replica's waiting requests as the score counts them (`effective_load`): its last
    stats plus the requests sent to it since (None: none)."""
    return {rid: effective_load(load, correction or Correction(0), now, config)[0]
            for rid, load, correction in zip(ids, loads, corrections, strict=True)}
