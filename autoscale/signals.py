"""One replica's load, as the router and the autoscaler see it.

`ReplicaLoad` is the one wire type of a replica's load: the replica builds it from the
engine's `EngineStats` snapshot (`from_engine_stats`) and returns it from
`record_routing_stats()` (as `to_dict()`, with its prefix cache's block hashes added by
`with_cached_blocks`) and `record_autoscaling_stats()` (as `to_autoscaling_metrics()`); the
router parses it back (`from_dict`), the autoscaling policy reads its metric names,
`/debug/replicas` shows `to_dict()` (built without the hashes), and the cluster simulator
passes it as is. The autoscaling metrics hold numbers only (Serve requires it); the routing
stats hold numbers plus, when the replica reports them, `cached_block_hashes` (a list of
ints: `replica/block_hashes.py`'s stable hashes) and `block_size`. Nothing here reads a
clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from iterserve.replica.stats import EngineStats

# Serve calls record_routing_stats every request_routing_stats_period_s; Serve's default is
# 10 s, far too stale for a KV watermark. RouterConfig.routing_stats_period_s defaults to this.
ROUTING_STATS_PERIOD_S = 0.5

# Names of the custom autoscaling metrics (ctx.aggregated_metrics[name][replica_id]); the
# same keys as the routing stats.
METRIC_KV_USAGE = "kv_usage"
METRIC_NUM_WAITING = "num_waiting"
METRIC_NUM_RUNNING = "num_running"
METRIC_DRAINING = "draining"  # optional: 1.0 while the replica drains (absent means 0)
AUTOSCALING_METRICS = (METRIC_KV_USAGE, METRIC_NUM_WAITING, METRIC_NUM_RUNNING, METRIC_DRAINING)


@dataclass(frozen=True)
class ReplicaLoad:
    """A snapshot of one replica's engine load.

    kv_usage: used / total KV blocks in [0, 1]. num_waiting: requests admitted to the engine
    but not yet running (preempted ones included). max_waiting_requests: the engine's
    waiting-queue bound (None: unbounded). timestamp: time.time() when the engine took the
    snapshot. draining: the replica is shutting down and admits nothing new.
    prefill_token_rate: prompt tokens it computes per second of step time in steps that
    prefill (0: not measured): how fast the prefills routed to it drain.
    queued_prefill_tokens: prompt tokens of its admitted requests not computed yet at
    timestamp (running prefills and waiting requests).
    cached_block_hashes: the stable hashes (`replica/block_hashes.py`) of the blocks its
    prefix cache can hit, of `block_size` tokens each (None: not reported).
    """

    kv_usage: float
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    step_token_rate: float
    timestamp: float
    max_waiting_requests: int | None = None
    draining: bool = False
    num_preemptions: int = 0  # cumulative (dashboards and /debug/replicas)
    prefill_token_rate: float = 0.0
    queued_prefill_tokens: int = 0
    cached_block_hashes: frozenset[int] | None = None
    block_size: int = 0  # tokens per block of cached_block_hashes (0: none reported)
    # The LoRA adapters it holds read (their model names): a request for one of them needs
    # no load there (autoscale/lora_affinity.py).
    lora_adapters: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_usage <= 1.0 or math.isnan(self.kv_usage):
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if self.num_waiting < 0 or self.num_running < 0 or self.queued_prefill_tokens < 0:
            raise ValueError("num_waiting, num_running and queued_prefill_tokens must be >= 0")
        if not 0 <= self.num_free_blocks <= max(self.num_total_blocks, 0):
            raise ValueError(
                f"num_free_blocks ({self.num_free_blocks}) must be in "
                f"[0, num_total_blocks={self.num_total_blocks}]"
            )
        if not self.prefill_token_rate >= 0.0 or math.isinf(self.prefill_token_rate):
            raise ValueError(f"prefill_token_rate must be finite and >= 0, "
                             f"got {self.prefill_token_rate}")
        if self.cached_block_hashes is not None and self.block_size < 1:
            raise ValueError(f"cached_block_hashes need a block_size >= 1, got {self.block_size}")

    @classmethod
    def from_engine_stats(cls, stats: EngineStats, draining: bool = False) -> ReplicaLoad:
        return cls(
            kv_usage=min(1.0, max(0.0, float(stats.kv_usage))),
            num_waiting=int(stats.num_waiting),
            num_running=int(stats.num_running),
            num_free_blocks=int(stats.num_free_blocks),
            num_total_blocks=int(stats.num_total_blocks),
            step_token_rate=float(stats.step_token_rate),
            timestamp=float(stats.timestamp),
            max_waiting_requests=stats.max_waiting_requests,
            draining=draining,
            num_preemptions=int(stats.num_preemptions),
            prefill_token_rate=float(stats.prefill_token_rate),
            queued_prefill_tokens=int(stats.queued_prefill_tokens),
        )

    def with_cached_blocks(self, hashes: Iterable[int] | None, block_size: int) -> ReplicaLoad:
        """This load with the replica's prefix-cache report (None: no report)."""
        if hashes is None:
            return replace(self, cached_block_hashes=None, block_size=0)
        return replace(self, cached_block_hashes=frozenset(hashes), block_size=block_size)

    def with_adapters(self, names: Iterable[str]) -> ReplicaLoad:
        """This load with the LoRA adapters the replica holds."""
        return replace(self, lora_adapters=frozenset(names))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaLoad:
        """Parse what record_routing_stats returned; raises ValueError if malformed."""
        try:
            max_waiting = data.get("max_waiting_requests")
            return cls(
                kv_usage=float(data["kv_usage"]),
                num_waiting=int(float(data["num_waiting"])),
                num_running=int(float(data["num_running"])),
                num_free_blocks=int(float(data.get("num_free_blocks", 0))),
                num_total_blocks=int(float(data.get("num_total_blocks", 0))),
                step_token_rate=float(data.get("step_token_rate", 0.0)),
                timestamp=float(data["timestamp"]),
                # to_dict sends -1.0 for an unbounded queue (numbers only)
                max_waiting_requests=(
                    None if max_waiting is None or float(max_waiting) < 0 else int(max_waiting)
                ),
                draining=float(data.get("draining", 0.0)) >= 0.5,
                num_preemptions=int(float(data.get("num_preemptions", 0))),
                prefill_token_rate=float(data.get("prefill_token_rate", 0.0)),
                queued_prefill_tokens=int(float(data.get("queued_prefill_tokens", 0))),
                **_cached_blocks_of(data),
                lora_adapters=_adapters_of(data),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed routing stats {dict(data)!r}: {exc}") from exc

    @classmethod
    def try_from_dict(cls, data: Mapping[str, Any] | None) -> ReplicaLoad | None:
        """`from_dict`, or None for empty or malformed stats (a replica not yet polled)."""
        if not data:
            return None
        try:
            return cls.from_dict(data)
        except ValueError:
            return None

    def to_dict(self) -> dict[str, float | list[int] | list[str]]:
        """The return value of `record_routing_stats()`; `from_dict` reads it. Numbers, plus
        the cached block hashes as a list of ints when reported, and the adapters held."""
        data: dict[str, float | list[int] | list[str]] = {
            f.name: float(getattr(self, f.name)) for f in fields(self)
            if f.name not in _NOT_PLAIN_NUMBERS}
        data["max_waiting_requests"] = float(
            -1 if self.max_waiting_requests is None else self.max_waiting_requests)
        data["draining"] = 1.0 if self.draining else 0.0
        if self.cached_block_hashes is not None:
            data["cached_block_hashes"] = list(self.cached_block_hashes)
            data["block_size"] = float(self.block_size)
        if self.lora_adapters:
            data["lora_adapters"] = sorted(self.lora_adapters)
        return data

    def to_autoscaling_metrics(self) -> dict[str, float]:
        """Numbers only: the return value of `record_autoscaling_stats()`."""
        return {
            METRIC_KV_USAGE: self.kv_usage,
            METRIC_NUM_WAITING: float(self.num_waiting),
            METRIC_NUM_RUNNING: float(self.num_running),
            METRIC_DRAINING: 1.0 if self.draining else 0.0,
        }


_NOT_PLAIN_NUMBERS = ("max_waiting_requests", "draining", "cached_block_hashes", "block_size",
                      "lora_adapters")


def _adapters_of(data: Mapping[str, Any]) -> frozenset[str]:
    names = data.get("lora_adapters") or ()
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(
            isinstance(n, str) for n in names):
        raise ValueError("lora_adapters must be a list of names")
    return frozenset(names)


def _cached_blocks_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """from_dict's cached_block_hashes and block_size fields (empty: not reported)."""
    hashes = data.get("cached_block_hashes")
    if hashes is None:
        return {}
    if not isinstance(hashes, (list, tuple, set, frozenset)) or not all(
            isinstance(h, int) for h in hashes):
        raise ValueError("cached_block_hashes must be a list of ints")
    return {"cached_block_hashes": frozenset(hashes),
            "block_size": int(float(data.get("block_size", 0)))}
