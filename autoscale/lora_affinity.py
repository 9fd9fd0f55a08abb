"""LoRA adapter affinity: send a request for an adapter where the adapter is already held.

A replica that does not hold a request's adapter reads it from disk first (milliseconds to
seconds, before the request's prefill), so the router prefers the best-ranked replica that
reports holding it (`ReplicaLoad.lora_adapters`), under a load guard: only while that replica
waits at most `lora_affinity_slack` requests more than the replica the score put first.
Beyond, load wins: the leader gets the request and reads the adapter, so an adapter whose
traffic outgrows one replica spreads over more replicas instead of queueing on the one that
held it first (the pinning Ray Serve's multiplexing shows, ray#65691). Pure functions: the
Ray router (router.py) calls them after ranking.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

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
                           adapter: str | None, slack: float) -> list[R]:
    """`ranked` (best first) with the best-ranked replica holding `adapter` moved to the
    front, if it is not draining and waits at most `slack` requests more than the leader."""
    order = list(ranked)
    if adapter is None or not order:
        return order
    leader = loads.get(order[0])
    if leader is not None and adapter in leader.lora_adapters:
        return order
    leader_waiting = leader.num_waiting if leader is not None else 0
    for position, replica in enumerate(order):
        load = loads.get(replica)
        if load is None or load.draining or adapter not in load.lora_adapters:
            continue
        if load.num_waiting <= leader_waiting + slack:
            return [replica, *order[:position], *order[position + 1:]]
    return order
