"""One replica's load, as the router and the autoscaler see it.

`ReplicaLoad` is the one wire type of a replica's load: the replica builds it from the
engine's `EngineStats` snapshot (`from_engine_stats`) and returns it from
`record_routing_stats()` (as `to_dict()`, with its prefix cache's block hashes added by
`with_cached_blocks`) and `record_autoscaling_stats()` (as `to_autoscaling_metrics()`); the
router parses it back (`from_dict`), the autoscaling policy reads its metric names,
`/debug/replicas` shows `to_dict()` (built without the hashes), and the cluster simulator
passes it as is. The autoscaling metrics hold numbers only (Serve requires it); the routing
stats hold numbers plus, when the replica reports them, `cached_blocks` and `block_size`:
per KV tier (`KV_TIERS`: "device", "host", "disk"), the stable hashes
(`replica/block_hashes.py`) of the blocks a lookup would read there, packed as 8-byte
little-endian words (`pack_hashes`: 0.76x a pickled list of ints, 0.37x its JSON; capped at
MAX_REPORTED_BLOCK_HASHES in all by the replica). `from_dict` also reads the earlier wire
form, `cached_block_hashes` (a list of ints: the device tier), and skips tier names it does
not know (a newer replica's). Nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from iterserve.replica.block_hashes import DEVICE, KV_TIERS
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
    device prefix cache can hit, of `block_size` tokens each (None: not reported).
    lower_tier_hashes: the same for the tiers below the device KV that hold blocks
    ("host", "disk"; a block in several tiers is listed in the best one only).
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
    # The adapters of its running requests and its adapter slots (0: not reported): a
    # request for another adapter waits for a slot where max_loras of them already run.
    lora_running: frozenset[str] = frozenset()
    max_loras: int = 0
    lower_tier_hashes: Mapping[str, frozenset[int]] = field(default_factory=dict)
    # KV bytes a token of its cache takes (0: not reported; RouterConfig.kv_bytes_per_token
    # is assumed then): the copies the router prices (kv_tier_costs.py, pull_pricing.py).
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_usage <= 1.0 or math.isnan(self.kv_usage):
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if self.num_waiting < 0 or self.num_running < 0 or self.queued_prefill_tokens < 0 \
                or self.max_loras < 0 or self.kv_bytes_per_token < 0:
            raise ValueError("num_waiting, num_running, queued_prefill_tokens, max_loras and "
                             "kv_bytes_per_token must be >= 0")
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
        if self.lower_tier_hashes and (self.cached_block_hashes is None or not set(
                self.lower_tier_hashes) <= set(KV_TIERS[1:])):
            raise ValueError(f"lower_tier_hashes name tiers of {KV_TIERS[1:]} beside a device "
                             f"report, got {sorted(self.lower_tier_hashes)}")

    def tier_hashes(self) -> list[tuple[str, frozenset[int]]]:
        """(tier, hashes) best first (`KV_TIERS` order), the tiers reported; [] if none."""
        if self.cached_block_hashes is None:
            return []
        lower = self.lower_tier_hashes
        return [(DEVICE, self.cached_block_hashes)] + [
            (tier, lower[tier]) for tier in KV_TIERS[1:] if tier in lower]

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
            lora_running=frozenset(stats.running_lora_adapters),
            max_loras=int(stats.max_loras),
            kv_bytes_per_token=int(stats.kv_bytes_per_token),
        )

    def with_cached_blocks(self, hashes: Mapping[str, Iterable[int]] | Iterable[int] | None,
                           block_size: int) -> ReplicaLoad:
        """This load with the replica's prefix-cache report: per tier (the engine's
        `cached_block_hashes()`), or the device tier's hashes alone (None: no report)."""
        if hashes is None:
            return replace(self, cached_block_hashes=None, block_size=0, lower_tier_hashes={})
        if not isinstance(hashes, Mapping):
            hashes = {DEVICE: hashes}
        lower = {tier: frozenset(h) for tier, h in hashes.items() if tier != DEVICE and h}
        return replace(self, cached_block_hashes=frozenset(hashes.get(DEVICE, ())),
                       block_size=block_size, lower_tier_hashes=lower)

    def with_adapters(self, names: Iterable[str]) -> ReplicaLoad:
        """This load with the LoRA adapters the replica holds."""
        return replace(self, lora_adapters=frozenset(names))

    def has_slot_for(self, adapter: str) -> bool:
        """Whether a request for `adapter` can run at once as far as adapter slots go: it
        runs there already, or fewer than max_loras adapters run (not reported: yes)."""
        return (not self.max_loras or adapter in self.lora_running
                or len(self.lora_running) < self.max_loras)

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
                lora_adapters=_adapters_of(data, "lora_adapters"),
                lora_running=_adapters_of(data, "lora_running"),
                max_loras=int(float(data.get("max_loras", 0))),
                kv_bytes_per_token=int(float(data.get("kv_bytes_per_token", 0))),
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

    def to_dict(self) -> dict[str, float | dict[str, bytes] | list[str]]:
        """The return value of `record_routing_stats()`; `from_dict` reads it. Numbers, plus
        the cached block hashes per tier, packed (`pack_hashes`), when reported, and the
        adapters held."""
        data: dict[str, float | dict[str, bytes] | list[str]] = {
            f.name: float(getattr(self, f.name)) for f in fields(self)
            if f.name not in _NOT_PLAIN_NUMBERS}
        data["max_waiting_requests"] = float(
            -1 if self.max_waiting_requests is None else self.max_waiting_requests)
        data["draining"] = 1.0 if self.draining else 0.0
        if self.cached_block_hashes is not None:
            data["cached_blocks"] = {tier: pack_hashes(hashes)
                                     for tier, hashes in self.tier_hashes()}
            data["block_size"] = float(self.block_size)
        if self.lora_adapters:
            data["lora_adapters"] = sorted(self.lora_adapters)
        if self.lora_running:
            data["lora_running"] = sorted(self.lora_running)
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
                      "lora_adapters", "lora_running", "lower_tier_hashes")
_WORD = np.dtype("<u8")  # one stable hash on the wire: 8 bytes, little-endian


def pack_hashes(hashes: Iterable[int]) -> bytes:
    """Stable block hashes (unsigned 64-bit) as 8 little-endian bytes each."""
    return np.fromiter(hashes, _WORD).tobytes()


def unpack_hashes(packed: bytes) -> frozenset[int]:
    """pack_hashes' inverse; ValueError unless it is whole 8-byte words."""
    if len(packed) % _WORD.itemsize:
        raise ValueError(f"packed block hashes must be 8-byte words, got {len(packed)} bytes")
    return frozenset(np.frombuffer(packed, _WORD).tolist())


def _hash_set(value: Any) -> frozenset[int]:  # noqa: ANN401
    """One tier's hashes as the wire holds them: packed bytes, or a list of ints."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return unpack_hashes(bytes(value))
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(
            isinstance(h, int) for h in value):
        raise ValueError("cached block hashes must be packed bytes or a list of ints")
    return frozenset(value)


def _adapters_of(data: Mapping[str, Any], key: str) -> frozenset[str]:
    names = data.get(key) or ()
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(
            isinstance(n, str) for n in names):
        raise ValueError(f"{key} must be a list of names")
    return frozenset(names)


def _cached_blocks_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """from_dict's cached_block_hashes, lower_tier_hashes and block_size fields (empty: not
    reported): the per-tier form, else the earlier device-only list."""
    tiers = data.get("cached_blocks")
    if tiers is None:
        hashes = data.get("cached_block_hashes")
        if hashes is None:
            return {}
        tiers = {DEVICE: hashes}
    if not isinstance(tiers, Mapping):
        raise ValueError("cached_blocks must map tier names to hashes")
    known = {tier: _hash_set(value) for tier, value in tiers.items() if tier in KV_TIERS}
    return {"cached_block_hashes": known.pop(DEVICE, frozenset()),
            "lower_tier_hashes": {tier: h for tier, h in known.items() if h},
            "block_size": int(float(data.get("block_size", 0)))}
