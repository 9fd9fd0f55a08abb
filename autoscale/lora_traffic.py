"""`AdapterTraffic`: each LoRA adapter's share of a router's recent requests, and the rule
that decides when a hot adapter needs another replica.

A replica serves about 1/n of the cluster's requests (n replicas). An adapter whose share
of the requests is s needs s * n replicas' worth of serving: while fewer replicas hold it
than that, its holders cannot serve it however the router balances among them, and their
queues grow until the load guard (`lora_affinity_slack`) pushes requests elsewhere, which
then read the adapter one spill at a time (the tournament's 32-replica LoRA cells: p99 TTFT
0.396 s against Ray's 0.256 s with the hot adapter on 6 replicas for 6.2 replicas' worth;
elsewhere the spills spread it to more replicas than its share: 29-49 hot spreads against
Ray's ~25). So the router spreads an adapter to a new replica when, and only when, its rate
per holder is above a replica's share of the cluster's rate (`needs_another_holder`), and
keeps it on its holders otherwise.

The rate is what this router routed: a count per adapter (and one for every request, the
base model's included) decayed with a half-life, so the share is the ratio of two counts
decayed alike and needs no clock of its own. Each ingress router sees a random part of the
traffic, so the share it sees estimates the cluster's without any exchange between them.
Plain data: times are passed in; the Ray router (router.py) and the simulator's
(sim/iterserve_router.py) keep one each and record what they route.
"""

from __future__ import annotations

# An adapter whose decayed count falls below this is forgotten (its share is then 0.0):
# after ~10 half-lives without a request, a share no replica's worth of traffic reaches.
FORGET_BELOW = 1e-3
PRUNE_EVERY = 1024  # requests recorded between sweeps for forgotten adapters


class AdapterTraffic:
    """Requests per adapter (and in all) this router routed, decayed with a half-life."""

    def __init__(self, half_life_s: float) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._half_life_s = half_life_s
        self._counts: dict[str, tuple[float, float]] = {}  # adapter -> (count, as of time)
        self._total = (0.0, 0.0)
        self._recorded = 0

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        count, at = entry
        return count * 0.5 ** (max(0.0, now - at) / self._half_life_s)

    def record(self, adapter: str | None, now: float) -> None:
        """One request routed (adapter None: the base model's, counted in the total only)."""
        self._total = (self._decayed(self._total, now) + 1.0, now)
        if adapter is not None:
            entry = self._counts.get(adapter)
            self._counts[adapter] = ((0.0 if entry is None else self._decayed(entry, now))
                                     + 1.0, now)
        self._recorded += 1
        if self._recorded % PRUNE_EVERY == 0:
            self._forget_quiet_adapters(now)

    def share(self, adapter: str, now: float, replicas: int) -> float:
        """The adapter's share of the recent requests, in [0, 1] (0.0: none recorded), as if
        the router had also counted one request of no adapter per replica: a share above
        k replicas' needs some n/k requests to show, and without these the first few
        requests of a run spread the hottest adapter at once (3 of the first 8 in a
        32-replica cell read as 0.375, 12 replicas' worth: 14 replicas read it, for 6.2
        replicas' worth of traffic). The added count is negligible once the router has
        counted many times n requests."""
        entry = self._counts.get(adapter)
        if entry is None:
            return 0.0
        total = self._decayed(self._total, now) + max(0, replicas)
        return min(1.0, self._decayed(entry, now) / total)

    def _forget_quiet_adapters(self, now: float) -> None:
        for adapter in [a for a, e in self._counts.items()
                        if self._decayed(e, now) < FORGET_BELOW]:
            del self._counts[adapter]

    def __len__(self) -> int:
        """Adapters remembered."""
        return len(self._counts)


def needs_another_holder(share: float, holders: int, replicas: int) -> bool:
    """Whether an adapter with this share of the requests needs more than `holders` of the
    `replicas`: its rate per holder (share * rate / holders) is above a replica's share of
    the cluster's rate (rate / replicas), so its holders alone cannot serve it. An adapter
    nobody holds: True when it has any traffic (the caller reads it somewhere anyway)."""
    if replicas <= 0 or share <= 0.0:
        return False
    return share * replicas > holders
