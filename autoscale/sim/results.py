"""What the cluster simulator gives back: a record per request and the run's result.

Everything is plain data and JSON-able, so a result can be compared byte for byte
(`SimResult.to_json`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from iterserve.autoscale.percentile import percentile, percentile_of_counts


@dataclass(slots=True)
class RequestRecord:
    """One request's fate. Times are virtual seconds; None where it never got that far."""

    request_id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    router: int
    replica: str | None = None
    routed: float | None = None
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the replica's prefix cache
    preemptions: int = 0
    itl_max: float = 0.0  # the longest gap between two of its tokens
    itl_p99: float = 0.0
    rejected: bool = False  # refused at once by SLO admission (a 429), never queued

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class SimResult:
    """Everything `simulate` measured.

    replicas_over_time: (t, running, starting, draining) at every change. gpu_seconds:
    replica-seconds from scale decision to stop (a starting GPU is paid for). itl_counts:
    every inter-token gap of every request, rounded to sim.itl.ITL_RESOLUTION_S, as {gap: count}.
    """

    records: list[RequestRecord]
    replicas_over_time: list[tuple[float, int, int, int]]
    gpu_seconds: float
    end_time: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    itl_counts: dict[float, int]
    num_steps: int
    router_names: list[str]
    autoscaler_name: str | None
    # With KV tiers (ClusterSimConfig.kv_tiers): their traffic (sim.kv_tiers.tier_tokens)
    tier_tokens: dict[str, float] = field(default_factory=dict)
    # With LoRA adapters (ClusterSimConfig.lora): the replicas' adapter loads (sim.lora)
    adapter_loads: dict[str, int] = field(default_factory=dict)
    # ... and per adapter, how many replicas read it from disk (sim.lora.adapter_readers)
    adapter_readers: dict[str, int] = field(default_factory=dict)
    # With KV pulls (ClusterSimConfig.kv_pulls): their counts (sim.kv_pull.KVPulls.summary)
    kv_pulls: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------- summaries
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.records if r.ttft is not None]

    def ttft_percentile(self, q: float) -> float:
        return percentile(self.ttfts(), q)

    def itl_percentile(self, q: float) -> float:
        return percentile_of_counts(self.itl_counts, q)

    @property
    def num_finished(self) -> int:
        return sum(1 for r in self.records if r.done)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens \
            else 0.0

    def throughput(self) -> float:
        """Output tokens per second, first arrival to last finish."""
        done = [r for r in self.records if r.done]
        if not done:
            return 0.0
        span = max(r.finish for r in done) - min(r.arrival for r in self.records)
        return sum(r.output_tokens for r in done) / span if span > 0 else math.inf

    def goodput(self, ttft_slo_s: float, itl_slo_s: float) -> float:
        """Requests per second that finished with TTFT and their own p99 ITL within the SLO."""
        if not self.records:
            return 0.0
        good = sum(1 for r in self.records if r.done and r.ttft <= ttft_slo_s
                   and r.itl_p99 <= itl_slo_s)
        span = max(self.end_time - min(r.arrival for r in self.records), 1e-9)
        return good / span

    def summary(self) -> dict[str, Any]:
        return {
            "routers": self.router_names,
            "autoscaler": self.autoscaler_name,
            "requests": len(self.records),
            "finished": self.num_finished,
            "ttft_p50_s": self.ttft_percentile(50),
            "ttft_p99_s": self.ttft_percentile(99),
            "itl_p99_s": self.itl_percentile(99),
            "throughput_tok_s": self.throughput(),
            "preemptions": sum(r.preemptions for r in self.records),
            "prefix_hit_rate": self.prefix_hit_rate,
            "gpu_hours": self.gpu_seconds / 3600.0,
            "end_time_s": self.end_time,
            "engine_steps": self.num_steps,
            **self._tier_summary(),
            **({"adapter_loads": dict(self.adapter_loads)} if self.adapter_loads else {}),
            **({"kv_pulls": dict(self.kv_pulls)} if self.kv_pulls else {}),
        }

    def _tier_summary(self) -> dict[str, Any]:
        """With KV tiers: the hit rate counting every tier, and the tiers' traffic."""
        if not self.tier_tokens:
            return {}
        hits = self.prefix_hit_tokens + self.tier_tokens["host_hit_tokens"]
        return {"all_tier_hit_rate": hits / self.prefix_query_tokens
                if self.prefix_query_tokens else 0.0, "kv_tiers": dict(self.tier_tokens)}

    def to_json(self) -> str:
        """Canonical JSON of the whole result: equal runs give equal strings."""
        data = {
            "summary": self.summary(),
            "records": [asdict(r) for r in self.records],
            "replicas_over_time": self.replicas_over_time,
            "itl_counts": sorted(self.itl_counts.items()),
        }
        return json.dumps(data, sort_keys=True)

