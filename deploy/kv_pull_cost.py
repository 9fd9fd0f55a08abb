"""When pulling a prefix's KV from another replica beats computing it: a pure cost rule.

A pull costs a fixed latency (a handle call to the holder, its copy between two of its steps,
the object-store hand-off) plus its bytes over the object store's bandwidth as this replica
measured it on earlier pulls; computing costs the missing tokens over this replica's measured
prefill rate. Both rates are measured where they are used, so the rule follows the machine:
on one node the object store is shared memory (GB/s), across nodes it would be the network.
"""

from __future__ import annotations

from dataclasses import dataclass

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
