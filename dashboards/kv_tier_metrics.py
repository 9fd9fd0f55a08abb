"""The KV tiers' metrics below the device KV: the host tier and the disk tier under it.

vLLM's names where vLLM has them: `external_prefix_cache_queries` / `_hits` count, in prompt
tokens, what the device prefix cache missed and what any tier below it supplied (as vLLM's KV
connectors count theirs); `kv_offload_total_bytes` / `_time` by `transfer_type` in vLLM's
"<from>_to_<to>" form (GPU_to_CPU, CPU_to_GPU for the host tier; CPU_to_DISK, DISK_to_CPU for
the disk tier: its writes, and its reads, whose seconds are the disk hits' read times).
iterserve's own: `kv_tier_queries` / `kv_tier_hits` by `tier` (host, disk; misses = queries -
hits) and `kv_disk_errors` by `reason` (corrupt, read_failed, disk_full, write_failed,
dropped: each a block computed instead). Every series exists from the start, at 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iterserve.dashboards.sinks import LABEL_REPLICA, MetricSink, MetricSpec

if TYPE_CHECKING:
    from iterserve.replica.stats import EngineStats

LABEL_TRANSFER_TYPE = "transfer_type"
# replica/host_kv_tier.py's and replica/disk_kv_tier.py's, without importing torch
TRANSFER_TYPES = ("GPU_to_CPU", "CPU_to_GPU", "CPU_to_DISK", "DISK_to_CPU")
LABEL_TIER = "tier"
TIERS = ("host", "disk")
LABEL_REASON = "reason"
DISK_ERRORS = ("corrupt", "read_failed", "disk_full", "write_failed", "dropped")
_ENGINE_LABELS = ("model_name", LABEL_REPLICA)


def _counter(key: str, doc: str, extra: tuple[str, ...] = (), vllm: bool = True) -> MetricSpec:
    return MetricSpec(key, "counter", doc, (*_ENGINE_LABELS, *extra),
                      vllm_key=key if vllm else None)


EXTERNAL_PREFIX_CACHE_QUERIES = _counter(
    "external_prefix_cache_queries",
    "KV tiers below the device: queries, in prompt tokens the device prefix cache missed.")
EXTERNAL_PREFIX_CACHE_HITS = _counter(
    "external_prefix_cache_hits",
    "KV tiers below the device: hits, in prompt tokens copied back (host and disk tiers).")
KV_OFFLOAD_TOTAL_BYTES = _counter(
    "kv_offload_total_bytes", "Bytes of KV blocks copied between KV tiers, by transfer type.",
    (LABEL_TRANSFER_TYPE,))
KV_OFFLOAD_TOTAL_TIME = _counter(
    "kv_offload_total_time", "Seconds spent copying KV blocks between KV tiers, by transfer "
    "type (DISK_to_CPU: disk hits' reads).", (LABEL_TRANSFER_TYPE,))
KV_TIER_QUERIES = _counter(
    "kv_tier_queries", "Prompt tokens looked up in a KV tier below the device (host: those the "
    "device missed; disk: those the host missed too).", (LABEL_TIER,), vllm=False)
KV_TIER_HITS = _counter(
    "kv_tier_hits", "Prompt tokens a KV tier below the device supplied.", (LABEL_TIER,),
    vllm=False)
KV_DISK_ERRORS = _counter(
    "kv_disk_errors", "Disk KV tier blocks not written or not read back, by reason (each one "
    "computed instead).", (LABEL_REASON,), vllm=False)

KV_TIER_METRICS: tuple[MetricSpec, ...] = (
    EXTERNAL_PREFIX_CACHE_QUERIES, EXTERNAL_PREFIX_CACHE_HITS, KV_OFFLOAD_TOTAL_BYTES,
    KV_OFFLOAD_TOTAL_TIME, KV_TIER_QUERIES, KV_TIER_HITS, KV_DISK_ERRORS)


class KVTierRecorder:
    """Turns the engine's cumulative tier totals into counter increments."""

    def __init__(self, sink: MetricSink, labels: dict[str, str]) -> None:
        self._sink = sink
        self._labels = labels
        # (metric, label value) -> the engine's cumulative total at the last record
        self._last: dict[tuple[str, str], float] = {}

    def _labelled(self, spec: MetricSpec, value: str) -> dict[str, str]:
        if len(spec.labels) == len(_ENGINE_LABELS):
            return self._labels
        return {**self._labels, spec.labels[-1]: value}

    def create_series(self) -> None:
        for spec, values in ((EXTERNAL_PREFIX_CACHE_QUERIES, ("",)),
                             (EXTERNAL_PREFIX_CACHE_HITS, ("",)),
                             (KV_OFFLOAD_TOTAL_BYTES, TRANSFER_TYPES),
                             (KV_OFFLOAD_TOTAL_TIME, TRANSFER_TYPES),
                             (KV_TIER_QUERIES, TIERS), (KV_TIER_HITS, TIERS),
                             (KV_DISK_ERRORS, DISK_ERRORS)):
            for value in values:
                self._sink.counter_inc(spec, 0.0, self._labelled(spec, value))

    def _inc(self, spec: MetricSpec, value: str, total: float) -> None:
        """Add what the cumulative `total` grew by; a reset engine restarts from 0."""
        previous = self._last.get((spec.key, value), 0.0)
        delta = total - previous if total >= previous else total
        if delta:
            self._sink.counter_inc(spec, float(delta), self._labelled(spec, value))
        self._last[(spec.key, value)] = total

    def record(self, engine: EngineStats) -> None:
        self._inc(EXTERNAL_PREFIX_CACHE_QUERIES, "", engine.host_cache_queries)
        self._inc(EXTERNAL_PREFIX_CACHE_HITS, "",
                  engine.host_cache_hits + engine.disk_cache_hits)
        for tier, queries, hits in (
                ("host", engine.host_cache_queries, engine.host_cache_hits),
                ("disk", engine.disk_cache_queries, engine.disk_cache_hits)):
            self._inc(KV_TIER_QUERIES, tier, queries)
            self._inc(KV_TIER_HITS, tier, hits)
        for spec, totals in ((KV_OFFLOAD_TOTAL_BYTES, engine.kv_offload_bytes),
                             (KV_OFFLOAD_TOTAL_TIME, engine.kv_offload_seconds),
                             (KV_DISK_ERRORS, engine.disk_errors)):
            for value, total in totals.items():
                self._inc(spec, value, total)
