"""Summaries of one benchmark level: throughput, latency percentiles, goodput, KV watermark.

Definitions follow vLLM `bench serve` (see streaming.py): TTFT, TPOT = (E2E - TTFT)/(n - 1),
ITL = pooled gaps between text chunks, output tokens/s = all output tokens / level duration
(first send to last reply). Goodput = requests meeting every SLO / duration (DistServe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from iterserve.autoscale.percentile import percentile
from iterserve.loadtests.bench_client import LevelRun, RequestResult, ServerSample

SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Slo:
    """Thresholds in milliseconds; None means not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        timing = result.timing
        checks = ((self.ttft_ms, timing.ttft_s), (self.tpot_ms, timing.tpot_s or 0.0),
                  (self.e2e_ms, timing.e2e_s))
        return result.ok and all(limit is None or (value is not None and value * 1000 <= limit)
                                 for limit, value in checks)

    def describe(self) -> str:
        parts = [f"{name} <= {limit:g} ms" for name, limit in
                 (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("E2E", self.e2e_ms))
                 if limit is not None]
        return ", ".join(parts) or "none"


def parse_slo(items: Sequence[str]) -> Slo:
    """``["ttft:2000", "tpot:100"]`` (milliseconds, as vLLM's --goodput)."""
    limits: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"bad SLO {item!r}: want one of {SLO_METRICS} as name:milliseconds")
        limits[f"{name}_ms"] = float(value)
    return Slo(**limits)


def _ms(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) * 1000.0 if values else None


def _mean_ms(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) * 1000.0 if values else None


def _window(samples: Sequence[ServerSample], start: float, end: float) -> list[ServerSample]:
    return [s for s in samples if start <= s.t <= end]


def _counter_delta(samples: Sequence[ServerSample], attribute: str) -> float | None:
    if len(samples) < 2:
        return None
    return max(0.0, getattr(samples[-1], attribute) - getattr(samples[0], attribute))


def _token_arrivals(result: RequestResult) -> list[tuple[float, float]]:
    """(arrival time, tokens) per text chunk; a chunk's tokens are the request's average."""
    timing = result.timing
    if timing.first_token_at is None or not timing.text_chunks:
        return []
    per_chunk = timing.output_tokens / timing.text_chunks
    arrivals, now = [(timing.first_token_at, per_chunk)], timing.first_token_at
    for gap in timing.chunk_gaps:
        now += gap
        arrivals.append((now, per_chunk))
    return arrivals


def steady_throughput(run: LevelRun, min_window_s: float = 1.0) -> tuple[float | None, float]:
    """Output tokens/s while all `concurrency` requests were in flight: tokens that arrived
    between the level's start and the dispatch of its last request (so the final drain, when
    fewer requests remain, does not count). None if that window is shorter than
    `min_window_s`."""
    window = run.last_dispatch_at - run.started_at
    if window < min_window_s:
        return None, window
    tokens = sum(count for result in run.results if result.ok
                 for at, count in _token_arrivals(result) if at <= run.last_dispatch_at)
    return tokens / window, window


def summarise_level(run: LevelRun, samples: Sequence[ServerSample], slo: Slo) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    duration = max(run.finished_at - run.started_at, 1e-9)
    output_tokens = sum(r.timing.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    ttfts = [r.timing.ttft_s for r in ok if r.timing.ttft_s is not None]
    tpots = [r.timing.tpot_s for r in ok if r.timing.tpot_s is not None]
    e2es = [r.timing.e2e_s for r in ok if r.timing.e2e_s is not None]
    itls = [gap for r in ok for gap in r.timing.chunk_gaps]
    # One sample before and after the level bounds the counters' change across it.
    window = _window(samples, run.started_at - 1.0, run.finished_at + 1.0)
    inside = _window(samples, run.started_at, run.finished_at) or window
    kv = [s.kv_usage for s in inside]
    gpu = [s.gpu_utilisation for s in inside if s.gpu_utilisation is not None]
    good = sum(slo.met_by(r) for r in run.results)
    errors = sorted({r.timing.error for r in run.results if r.timing.error})[:3]
    steady, steady_window = steady_throughput(run)
    return {
        "concurrency": run.concurrency,
        "requests": len(run.results),
        "completed": len(ok),
        "failed": len(run.results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "steady_output_tokens_per_s": steady,
        "steady_window_s": steady_window,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / duration,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_ms_mean": _mean_ms(ttfts),
        "ttft_ms_p50": _ms(ttfts, 50), "ttft_ms_p95": _ms(ttfts, 95), "ttft_ms_p99": _ms(ttfts, 99),
        "tpot_ms_mean": _mean_ms(tpots), "tpot_ms_p50": _ms(tpots, 50),
        "tpot_ms_p99": _ms(tpots, 99),
        "itl_ms_p50": _ms(itls, 50), "itl_ms_p99": _ms(itls, 99),
        "e2e_ms_p50": _ms(e2es, 50), "e2e_ms_p99": _ms(e2es, 99),
        "kv_usage_peak": max(kv) if kv else None,
        "kv_usage_mean": sum(kv) / len(kv) if kv else None,
        "running_mean": sum(s.running for s in inside) / len(inside) if inside else None,
        "out_of_blocks": _counter_delta(window, "out_of_blocks"),
        "preemptions": _counter_delta(window, "preemptions"),
        "gpu_utilisation_mean": sum(gpu) / len(gpu) if gpu else None,
        "goodput_rps": good / duration,
        "goodput_fraction": good / len(run.results) if run.results else None,
        "server_samples": len(inside),
    }


@dataclass(frozen=True)
class FloorCheck:
    """The floors judge whole-level output tokens/s; the steady ratio is shown beside it."""

    concurrency: int
    throughput_ratio: float | None  # continuous / static output tokens/s
    ttft_p95_reduction: float | None  # 1 - continuous / static p95 TTFT
    steady_throughput_ratio: float | None = None
    min_ratio: float = 2.0
    min_reduction: float = 0.4

    @property
    def passed(self) -> bool:
        return (self.throughput_ratio is not None and self.ttft_p95_reduction is not None
                and self.throughput_ratio >= self.min_ratio
                and self.ttft_p95_reduction >= self.min_reduction)


def _level(levels: Sequence[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    return next((level for level in levels if level["concurrency"] == concurrency), None)


def compare(static_levels: Sequence[dict[str, Any]], continuous_levels: Sequence[dict[str, Any]],
            concurrency: int) -> FloorCheck:
    """Continuous vs static at one concurrency (the floors: >= 2x tokens/s, >= 40% lower
    p95 TTFT)."""
    static, continuous = _level(static_levels, concurrency), _level(continuous_levels, concurrency)
    if static is None or continuous is None:
        return FloorCheck(concurrency, None, None)
    ratio = (continuous["output_tokens_per_s"] / static["output_tokens_per_s"]
             if static["output_tokens_per_s"] else None)
    reduction = (1.0 - continuous["ttft_ms_p95"] / static["ttft_ms_p95"]
                 if static["ttft_ms_p95"] and continuous["ttft_ms_p95"] is not None else None)
    steady_static = static.get("steady_output_tokens_per_s")
    steady_continuous = continuous.get("steady_output_tokens_per_s")
    steady = (steady_continuous / steady_static
              if steady_static and steady_continuous is not None else None)
    return FloorCheck(concurrency, ratio, reduction, steady)
