"""`AdaptersInFlight`: the LoRA adapters of a router's own requests in flight, per replica.

A replica reports the adapters it holds and runs with its routing stats, and it holds an
adapter only once a request for it was admitted into a step: the report lags the router's
sends by the report interval plus the time the request waits in the replica's queue. Until
it shows, a request for an adapter no replica reports goes to whichever replica ranks best,
so a cold adapter is read from disk on two or three replicas where one would do, and each
of them mixes more adapters into its slots (the tournament's LoRA cells:
loadtests/studies/router_tournament/README.md). The router knows better: a replica it has a
request in flight on for an adapter holds that adapter, or will, and runs it (or will: the
request takes one of its max_loras slots), as the in-flight tracker counts the requests
the stats do not show in the replica's waiting count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import replace
from typing import Generic, TypeVar

from iterserve.autoscale.signals import ReplicaLoad

R = TypeVar("R", bound=Hashable)  # a replica id


class AdaptersInFlight(Generic[R]):
    """Per replica, how many of this router's requests in flight there name each adapter."""

    def __init__(self) -> None:
        self._by_request: dict[str, tuple[R, str]] = {}
        self._counts: dict[R, Counter[str]] = {}

    def routed(self, request_id: str, replica_id: R, adapter: str | None) -> None:
        """A request went to the replica (adapter None, the base model: not counted)."""
        self.completed(request_id)
        if adapter is not None:
            self._by_request[request_id] = (replica_id, adapter)
            self._counts.setdefault(replica_id, Counter())[adapter] += 1

    def completed(self, request_id: str) -> None:
        """The request finished (or was never known: ignored)."""
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return
        replica_id, adapter = entry
        counts = self._counts[replica_id]
        counts[adapter] -= 1
        if counts[adapter] == 0:
            del counts[adapter]
            if not counts:
                del self._counts[replica_id]

    def adapters(self, replica_id: R) -> frozenset[str]:
        """The adapters of this router's requests in flight on the replica."""
        return frozenset(self._counts.get(replica_id, ()))

    def keep_only(self, replica_ids: Iterable[R]) -> None:
        """Forget the requests on replicas that are gone."""
        keep = set(replica_ids)
        for request_id in [q for q, (r, _) in self._by_request.items() if r not in keep]:
            self.completed(request_id)


def with_adapters_in_flight(load: ReplicaLoad | None, adapters: frozenset[str]
                            ) -> ReplicaLoad | None:
    """The replica's load with the adapters of requests in flight there held and running
    (each takes a slot). No stats yet: an empty load holding and running them, its slots
    not reported (so it has room for any adapter, as a replica without stats is taken to);
    left None only with nothing in flight. Before, a replica's in-flight adapters counted
    only once it had reported, so until every replica's first report (up to a stats period
    into a run) each request for the hottest adapter found no holder and read it on yet
    another replica (a 32-replica cell: 13 of its 14 replicas)."""
    if not adapters:
        return load
    if load is None:
        return ReplicaLoad(kv_usage=0.0, num_waiting=0, num_running=0, num_free_blocks=0,
                           num_total_blocks=0, step_token_rate=0.0, timestamp=0.0,
                           lora_adapters=adapters, lora_running=adapters)
    return replace(load, lora_adapters=load.lora_adapters | adapters,
                   lora_running=load.lora_running | adapters)
