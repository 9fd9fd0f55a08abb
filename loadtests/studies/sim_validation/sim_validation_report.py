"""sim_validation's Markdown: the simulator beside the Ray path, per router.

Tables: (1) the simulator with the measured Ray-path latency vs Ray, with the 15 % floor
per figure; (2) the simulator without it (the engine alone); (3) where each Ray TTFT went
(dispatch, engine, return, from the run's own timestamps) beside the simulator's engine
TTFT; (4) Ray's PrefixCacheAffinityRouter beside our reimplementation, both on Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from iterserve.autoscale.percentile import percentile

FLOOR = 0.15  # |sim / Ray - 1| allowed on p50 TTFT, p99 TTFT and throughput
OURS = "ray-prefix (ours)"
RAYS = "PrefixCacheAffinityRouter (Ray 2.60)"


@dataclass(frozen=True)
class Row:
    arm: str
    ray: dict[str, Any]  # routing_experiment's summary of the Ray run
    sim: dict[str, Any]  # pooled simulator summary, with the Ray-path latency
    engine_sim: dict[str, Any]  # the same without it
    sim_cpu_s: float
    engine_cpu: tuple[float, float] = (0.0, 0.0)  # the term added: s per step, per sequence


def ratio(sim: float, ray: float) -> float:
    return sim / ray if ray else math.nan


def verdict(r: float) -> str:
    return "met" if abs(r - 1.0) <= FLOOR else "MISSED"


def _ms(summary: dict[str, Any], key: str) -> str:
    value = summary.get(key, math.nan)
    return f"{value * 1e3:.1f}"


def _seed_range(sim: dict[str, Any]) -> str:
    seeds = sorted(sim["ttft_p99_per_seed_s"])
    return f"{seeds[0]:.2f} / {percentile(seeds, 50):.2f} / {seeds[-1]:.2f}"


def _k_run_range(sim: dict[str, Any], ray_p99: float) -> str:
    """The simulator's p99 spread at Ray's sample size, and whether Ray's p99 falls in it."""
    low, high = sim["ttft_p99_k_run_95_s"]
    inside = "inside" if low <= ray_p99 <= high else "OUTSIDE"
    return f"k={sim['k_runs']}: {low:.2f}-{high:.2f} (Ray's {inside})"


def seed_rank(sim: dict[str, Any], ray_value: float) -> float:
    """The share of simulator seeds whose own p99 is below Ray's: where one Ray run's p99
    falls in the simulator's run-to-run spread (0.5: the middle)."""
    seeds = sim["ttft_p99_per_seed_s"]
    return sum(1 for x in seeds if x < ray_value) / len(seeds)


def main_table(rows: list[Row]) -> list[str]:
    lines = ["| router | Ray box load (1 min, at end) | TTFT p50 Ray / sim (s) | ratio "
             "| TTFT p99 Ray / sim (s) | ratio | sim p99 per seed min / median / max (s) "
             "| seeds below Ray's p99 | sim p99 95 % range of k-seed pools, k = Ray's runs "
             "| throughput Ray / sim (tok/s) | ratio | floor p50 / p99 / throughput "
             "| ITL p99 Ray / sim (s) | preemptions Ray / sim | prefix hit rate Ray / sim |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r, s = row.ray, row.sim
        ratios = [ratio(s[k], r[k]) for k in ("ttft_p50_s", "ttft_p99_s", "throughput_tok_s")]
        lines.append(
            f"| {row.arm} | {r.get('loadavg_1m_at_end', math.nan):.1f} | "
            f"{r['ttft_p50_s']:.3f} / {s['ttft_p50_s']:.3f} | {ratios[0]:.2f} | "
            f"{r['ttft_p99_s']:.3f} / {s['ttft_p99_s']:.3f} | {ratios[1]:.2f} | "
            f"{_seed_range(s)} | {seed_rank(s, r['ttft_p99_s']):.2f} | "
            f"{_k_run_range(s, r['ttft_p99_s'])} | "
            f"{r['throughput_tok_s']:.0f} / {s['throughput_tok_s']:.0f} | "
            f"{ratios[2]:.2f} | {' / '.join(verdict(x) for x in ratios)} | "
            f"{r['itl_p99_s']:.3f} / {s['itl_p99_s']:.3f} | "
            f"{r['preemptions']:g} / {s['preemptions']:g} | "
            f"{r.get('prefix_hit_rate', math.nan):.3f} / {s['prefix_hit_rate']:.3f} |")
    return lines


def engine_only_table(rows: list[Row]) -> list[str]:
    lines = ["| router | TTFT p50 sim (s) | ratio to Ray | TTFT p99 sim (s) | ratio to Ray "
             "| throughput ratio |", "|---|---|---|---|---|---|"]
    for row in rows:
        r, e = row.ray, row.engine_sim
        lines.append(f"| {row.arm} | {e['ttft_p50_s']:.3f} | "
                     f"{ratio(e['ttft_p50_s'], r['ttft_p50_s']):.2f} | {e['ttft_p99_s']:.3f} | "
                     f"{ratio(e['ttft_p99_s'], r['ttft_p99_s']):.2f} | "
                     f"{ratio(e['throughput_tok_s'], r['throughput_tok_s']):.2f} |")
    return lines


def split_table(rows: list[Row], probe: dict[str, Any]) -> list[str]:
    lines = ["| router | dispatch p50 / p99, Ray run | engine TTFT p50 / p99, Ray run "
             "| engine TTFT p50 / p99, sim | ratio p50 / p99 | return p50 / p99, Ray run |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        r, e = row.ray, row.engine_sim
        lines.append(
            f"| {row.arm} | {_ms(r, 'dispatch_p50_s')} / {_ms(r, 'dispatch_p99_s')} | "
            f"{_ms(r, 'engine_ttft_p50_s')} / {_ms(r, 'engine_ttft_p99_s')} | "
            f"{_ms(e, 'ttft_p50_s')} / {_ms(e, 'ttft_p99_s')} | "
            f"{ratio(e['ttft_p50_s'], r.get('engine_ttft_p50_s', math.nan)):.2f} / "
            f"{ratio(e['ttft_p99_s'], r.get('engine_ttft_p99_s', math.nan)):.2f} | "
            f"{_ms(r, 'return_p50_s')} / {_ms(r, 'return_p99_s')} |")
    lines.append(f"| (probe, one request in flight) | {_ms(probe, 'dispatch_p50_s')} / "
                 f"{_ms(probe, 'dispatch_p99_s')} | {_ms(probe, 'engine_ttft_p50_s')} / "
                 f"{_ms(probe, 'engine_ttft_p99_s')} | | | {_ms(probe, 'return_p50_s')} / "
                 f"{_ms(probe, 'return_p99_s')} |")
    return lines


def reimplementation_table(rows: list[Row]) -> list[str]:
    by_arm = {row.arm: row for row in rows}
    if OURS not in by_arm or RAYS not in by_arm:
        return [f"(needs both the `{OURS}` and the `{RAYS}` Ray arms)"]
    ours, rays = by_arm[OURS], by_arm[RAYS]
    metrics = [("TTFT p50 (s)", "ttft_p50_s", 1.0, 3), ("TTFT p99 (s)", "ttft_p99_s", 1.0, 3),
               ("throughput (tok/s)", "throughput_tok_s", 1.0, 0),
               ("ITL p99 (s)", "itl_p99_s", 1.0, 3), ("preemptions", "preemptions", 1.0, 0),
               ("prefix hit rate (cached / prompt tokens)", "prefix_hit_rate", 1.0, 3),
               ("dispatch p50 (ms)", "dispatch_p50_s", 1e3, 1),
               ("dispatch p99 (ms)", "dispatch_p99_s", 1e3, 1)]
    lines = [f"| figure | Ray path, {OURS} | Ray path, Ray's own | ours / Ray's "
             "| simulator, ours |", "|---|---|---|---|---|"]
    for label, key, scale, digits in metrics:
        a = ours.ray.get(key, math.nan) * scale
        b = rays.ray.get(key, math.nan) * scale
        sim = ours.sim.get(key)
        sim_text = "" if sim is None else f"{sim * scale:.{digits}f}"
        lines.append(f"| {label} | {a:.{digits}f} | {b:.{digits}f} | {ratio(a, b):.2f} "
                     f"| {sim_text} |")
    load = [f"{row.ray.get('loadavg_1m_at_end', math.nan):.1f}" for row in (ours, rays)]
    lines.append(f"| box load (1 min, at end) | {load[0]} | {load[1]} | | |")
    return lines


def engine_cpu_table(rows: list[Row]) -> list[str]:
    """The engine CPU term each arm's simulation used, beside what its Ray run measured."""
    lines = ["| router | term used: per step + per sequence (ms) | Ray run's replicas: mean "
             "wait per step (ms) at mean batch | single waits p50 / p99 / p99.9 / max (ms, "
             "bucket floors) | steps measured |", "|---|---|---|---|---|"]
    for row in rows:
        measured = row.ray.get("engine_cpu")
        seen = ("not recorded" if measured is None else
                f"{measured['mean_idle_s'] * 1e3:.2f} at {measured['mean_batch']:.1f}")
        spread = "not recorded"
        if measured is not None and "p99_idle_s" in measured:
            spread = " / ".join(f"{measured[k] * 1e3:.2f}" for k in
                                ("p50_idle_s", "p99_idle_s", "p999_idle_s", "max_idle_s"))
        steps = "" if measured is None else f"{measured['steps']:.0f}"
        lines.append(f"| {row.arm} | {row.engine_cpu[0] * 1e3:.3f} + "
                     f"{row.engine_cpu[1] * 1e3:.4f} | {seen} | {spread} | {steps} |")
    return lines


def write_report(rows: list[Row], ray: dict[str, Any], probe: dict[str, Any], command: str,
                 seeds: int) -> str:
    meta = ray["meta"]
    whens = sorted({m["when"] for m in ray["metas"]})
    requests = ray["results"][0]["summary"]["requests"]
    return "\n".join([
        "# Cluster simulator vs the Ray Serve path", "",
        f"`{command}`. Ray side: `routing_experiment` runs of {', '.join(whens)} "
        f"({meta['num_replicas']} replicas, time_scale {meta['time_scale']}, {requests} "
        f"requests x {meta['repeats']} run(s) per arm). Simulator: the same workload and "
        f"engine settings, {seeds} seeds per arm, pooled (and each seed's own p99). "
        f"Ray-path latency in the simulator, measured by `ray_path_latency` "
        f"({probe['when']}, {probe['requests']} requests one at a time, box load "
        f"{probe['loadavg_after'][0]:.1f}): dispatch_latency_s = its dispatch median "
        f"{probe['dispatch_p50_s'] * 1e3:.1f} ms, stream_latency_s = its return median "
        f"{probe['return_p50_s'] * 1e3:.1f} ms. Floor: sim / Ray within "
        f"{1 - FLOOR:.2f}-{1 + FLOOR:.2f}.", "",
        "## Simulator (with the measured Ray-path latency) vs Ray", "",
        *main_table(rows), "",
        "## The engine CPU term (added to every simulated step, real seconds)", "",
        *engine_cpu_table(rows), "",
        "## The simulator without the Ray-path latency (engine alone)", "",
        *engine_only_table(rows), "",
        "## Where each Ray TTFT went, ms (the run's own timestamps; sim: engine alone)", "",
        "dispatch: driver's handle call -> the replica's engine is called; engine TTFT: "
        "-> first token sampled (what the simulator models); return: -> the driver has it.",
        "", *split_table(rows, probe), "",
        "## Ray's own PrefixCacheAffinityRouter vs our reimplementation (both on Ray)", "",
        *reimplementation_table(rows), "",
    ])
