"""When pulling a prefix's KV from another replica beats computing it: a pure cost rule.

A pull costs a fixed latency (a handle call to the holder, its copy of the blocks,
the object-store hand-off) plus its bytes over the object store's bandwidth as this replica
measured it on earlier pulls; computing costs the missing tokens over this replica's measured
prefill rate. Both rates are measured where they are used, so the rule follows the machine:
on one node the object store is shared memory (GB/s), across nodes it would be the network.

The routers' side (`credit_pulls`, shared by the live KVAwareRouter and the simulator's
IterserveRouter): a replica that holds less of a prompt than another is worth what it holds
plus what a pull of the rest would save ("route here, pull from there"), so a busy holder's
idle peer can win the request without the prefix being charged as a full recompute.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

R = TypeVar("R", bound=Hashable)

# Before any pull is measured: a conservative single-node object-store rate (a pickled
# payload put and read once through shared memory), and a handle round trip with its hand-off.
ASSUMED_BANDWIDTH_BYTES_PER_S = 500e6
PULL_LATENCY_S = 0.02
BANDWIDTH_WEIGHT = 0.3  # of the newest pull in the moving average of measured bandwidth


def pull_seconds(num_bytes: int, bandwidth_bytes_per_s: float,
                 latency_s: float = PULL_LATENCY_S) -> float:
    return latency_s + num_bytes / bandwidth_bytes_per_s


def pull_beats_compute(num_tokens: int, num_bytes: int, bandwidth_bytes_per_s: float,
                       prefill_tokens_per_s: float | None,
                       latency_s: float = PULL_LATENCY_S) -> bool:
    """Whether pulling `num_tokens` (`num_bytes` of KV) is faster than prefilling them.
    prefill_tokens_per_s None: not measured yet (an idle replica), and a pull is tried."""
    if num_tokens <= 0:
        return False
    if prefill_tokens_per_s is None:
        return True
    return (pull_seconds(num_bytes, bandwidth_bytes_per_s, latency_s)
            < num_tokens / prefill_tokens_per_s)


@dataclass
class BandwidthMeter:
    """The object store's bandwidth as pulls measured it: bytes over each pull's seconds
    beyond the fixed latency (a pull slower to start than PULL_LATENCY_S reads as a lower
    bandwidth, which errs towards computing)."""

    bytes_per_s: float = ASSUMED_BANDWIDTH_BYTES_PER_S

    def record(self, num_bytes: int, seconds: float) -> None:
        moving = seconds - PULL_LATENCY_S
        if num_bytes <= 0 or moving <= 0:
            return
        observed = num_bytes / moving
        self.bytes_per_s += BANDWIDTH_WEIGHT * (observed - self.bytes_per_s)


def pull_fraction(num_tokens: int, kv_bytes_per_token: int, bandwidth_bytes_per_s: float,
                  prefill_tokens_per_s: float, latency_s: float = PULL_LATENCY_S) -> float:
    """A pulled token's cost as a share of prefilling it (1: no cheaper than computing)."""
    if num_tokens <= 0 or prefill_tokens_per_s <= 0:
        return 1.0
    pull_s = pull_seconds(num_tokens * kv_bytes_per_token, bandwidth_bytes_per_s, latency_s)
    return min(1.0, pull_s / (num_tokens / prefill_tokens_per_s))


def credit_pulls(charged: Mapping[R, int], pullable: Mapping[R, int], held: Mapping[R, int],
                 replica_ids: Sequence[R], fraction: Callable[[R, int], float]) -> dict[R, int]:
    """The cache answers a pull-aware router scores with. charged: each replica's own
    prefix worth in prefill tokens saved (the router's usual answer); pullable: the leading
    tokens each replica could send (device and host tiers); held: the leading tokens each
    replica's own lookup finds; fraction(replica, tokens): what pulling that many tokens to
    it costs as a share of prefilling them. Each replica is worth the most of its own answer
    and its own plus the best other holder's extra tokens at (1 - fraction)."""
    ranked = sorted(pullable.items(), key=lambda item: -item[1])[:2]
    answers = {rid: tokens for rid, tokens in charged.items() if tokens > 0}
    for rid in replica_ids:
        best = next((tokens for holder, tokens in ranked if holder != rid), 0)
        extra = best - held.get(rid, 0)
        if extra <= 0:
            continue
        share = fraction(rid, extra)
        if share < 1.0:
            credited = charged.get(rid, 0) + round(extra * (1.0 - share))
            answers[rid] = max(answers.get(rid, 0), credited)
    return answers
