"""The tenant-fairness cells' figures (per tenant, per cell) and their report.

Per tenant: requests, finished, refused (SLO admission), p50/p99 TTFT of those answered,
requests that met the tenant's TTFT objective, and the tokens (prompt + output) served
to it in the measuring window, the last two thirds of the arrivals (past the warm-up, while
every backlogged tenant has work waiting): a request's prompt counts when its first token
came, its output tokens spread evenly from its first token to its last (the records hold
no per-token times). Counting whole requests at their finish instead would credit the
window with work admitted before it (a request runs for seconds in a full batch). Per cell: SLO attainment
(met over all requests), of the admitted (met over those not refused), the rejection
rate, goodput (requests meeting their objective per second of arrivals), throughput in
the window; between backlogged tenants, Jain's fairness index of their served tokens each
divided by its weight (1: shares exactly by weight) and each tenant's share of the tokens
against its weight's share.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.sim.results import RequestRecord
from iterserve.autoscale.sim.tenancy import SimTenancy
from iterserve.autoscale.sim.workload import WorkloadRequest

WINDOW_START = 1 / 3  # of the arrivals' span: the measuring window starts past the warm-up


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one
    takes everything."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares > 0 else 1.0


def share_errors(tokens: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Each tenant's share of the tokens over its weight's share, minus 1 (0: exact)."""
    total, weight_total = sum(tokens.values()), sum(weights.values())
    return {name: (tokens[name] / total) / (weights[name] / weight_total) - 1
            if total > 0 else -1.0 for name in tokens}


def served_in(record: RequestRecord, start: float, end: float) -> float:
    """Tokens served to a finished request within [start, end] (module docstring)."""
    first, last = record.first_token, record.finish
    tokens = float(record.prompt_tokens) if start <= first <= end else 0.0
    if last > first:
        overlap = max(0.0, min(end, last) - max(start, first))
        return tokens + record.output_tokens * overlap / (last - first)
    return tokens + (record.output_tokens if start <= first <= end else 0.0)


def tenant_figures(records: list[RequestRecord], requests: list[WorkloadRequest],
                   tenancy: SimTenancy, duration_s: float) -> dict[str, Any]:
    """The cell's per-tenant and whole-cell figures (module docstring)."""
    tenant_of = {r.request_id: r.tenant for r in requests}
    window = (WINDOW_START * duration_s, duration_s)
    rows: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = defaultdict(list)
    for record in records:
        tenant = tenancy.tenant(tenant_of[record.request_id])
        row = rows.setdefault(tenant.name, {"weight": tenant.weight, "requests": 0,
                                            "finished": 0, "rejected": 0, "slo_met": 0,
                                            "window_tokens": 0})
        row["requests"] += 1
        row["rejected"] += record.rejected
        if record.ttft is not None:
            ttfts[tenant.name].append(record.ttft)
            met = tenant.ttft_slo_s is None or record.ttft <= tenant.ttft_slo_s
            row["slo_met"] += met
        if record.finish is not None:
            row["finished"] += 1
            row["window_tokens"] += served_in(record, *window)
    for name, row in rows.items():
        row["ttft_p50_s"] = percentile(ttfts[name], 50) if ttfts[name] else None
        row["ttft_p99_s"] = percentile(ttfts[name], 99) if ttfts[name] else None
    total = sum(r["requests"] for r in rows.values())
    rejected = sum(r["rejected"] for r in rows.values())
    met = sum(r["slo_met"] for r in rows.values())
    tokens = {name: float(r["window_tokens"]) for name, r in rows.items()}
    weights = {name: r["weight"] for name, r in rows.items()}
    return {
        "tenants": rows,
        "slo_attainment": met / total,
        "admitted_slo_attainment": met / max(1, total - rejected),
        "rejection_rate": rejected / total,
        "goodput_rps": met / duration_s,
        "throughput_tok_s": sum(tokens.values()) / (window[1] - window[0]),
        "jain_weighted_tokens": jain_index([tokens[n] / weights[n] for n in tokens]),
        "share_errors": share_errors(tokens, weights),
    }


# ----------------------------------------------------------------------------- report
def _spread(values: list[float], digits: int = 3) -> str:
    """median (min-max) over the seeds."""
    if not values:
        return "-"
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _by(results: list[dict[str, Any]], workload: str) -> dict[tuple[int, str, int], dict]:
    return {(r["replicas"], r["arm"], r["seed"]): r for r in results
            if r["workload"] == workload}


def noisy_table(results: list[dict[str, Any]]) -> str:
    noisy, base = _by(results, "noisy"), _by(results, "noisy-base")
    lines = ["| replicas | arm | b p99 TTFT noisy / base (s) | ratio (floor 1.5 at 32) | "
             "a's share of tokens | a refused | b refused | SLO attainment | of admitted | "
             "goodput (req/s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[int, str], list[tuple[dict, dict]]] = defaultdict(list)
    for (n, arm, seed), cell in sorted(noisy.items()):
        if (n, arm, seed) in base:
            groups[(n, arm)].append((cell, base[(n, arm, seed)]))
    for (n, arm), pairs in sorted(groups.items()):
        b_noisy = [c["tenants"]["b"]["ttft_p99_s"] for c, _ in pairs]
        b_base = [b["tenants"]["b"]["ttft_p99_s"] for _, b in pairs]
        ratios = [x / y for x, y in zip(b_noisy, b_base, strict=True)]
        a_share = [c["tenants"]["a"]["window_tokens"] / max(1, c["tenants"]["a"]["window_tokens"]
                   + c["tenants"]["b"]["window_tokens"]) for c, _ in pairs]
        cells = [c for c, _ in pairs]
        lines.append(
            f"| {n} | {arm} | {_spread(b_noisy)} / {_spread(b_base)} | {_spread(ratios, 2)} | "
            f"{_spread(a_share)} | "
            f"{_spread([c['tenants']['a']['rejected'] / c['tenants']['a']['requests'] for c in cells])} | "
            f"{_spread([float(c['tenants']['b']['rejected']) for c in cells], 0)} | "
            f"{_spread([c['slo_attainment'] for c in cells])} | "
            f"{_spread([c['admitted_slo_attainment'] for c in cells])} | "
            f"{_spread([c['goodput_rps'] for c in cells], 1)} |")
    return "\n".join(lines) + "\n"


def backlogged_table(results: list[dict[str, Any]], workload: str) -> str:
    cells = _by(results, workload)
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for (n, arm, _), cell in sorted(cells.items()):
        groups[(n, arm)].append(cell)
    if not groups:
        return ""
    names = sorted(next(iter(groups.values()))[0]["tenants"],
                   key=lambda t: (next(iter(groups.values()))[0]["tenants"][t]["weight"], t))
    lines = [f"| replicas | arm | Jain (tokens / weight) | {' | '.join(f'{t} share error' for t in names)} "
             f"| worst share error | {' | '.join(f'{t} p99 TTFT (s)' for t in names)} |",
             "|---|---|---|" + "---|" * (2 * len(names) + 1)]
    for (n, arm), group in sorted(groups.items()):
        errors = [_spread([c["share_errors"][t] for c in group], 3) for t in names]
        worst = [max(abs(e) for e in c["share_errors"].values()) for c in group]
        p99 = [_spread([c["tenants"][t]["ttft_p99_s"] or 0.0 for c in group], 2) for t in names]
        lines.append(f"| {n} | {arm} | {_spread([c['jain_weighted_tokens'] for c in group])} | "
                     + " | ".join(errors) + f" | {_spread(worst)} | " + " | ".join(p99) + " |")
    return "\n".join(lines) + "\n"


def solo_table(results: list[dict[str, Any]]) -> str:
    cells = _by(results, "solo")
    lines = ["| replicas | arm | arm / fcfs throughput in the window, per seed "
             "(floor >= 0.97) |", "|---|---|---|"]
    for n, arm in sorted({(n, arm) for n, arm, _ in cells if arm != "fcfs"}):
        ratios = [cells[(n, arm, s)]["throughput_tok_s"] / cells[(n, "fcfs", s)]["throughput_tok_s"]
                  for (m, a, s) in sorted(cells) if m == n and a == "fcfs"
                  and (n, arm, s) in cells]
        lines.append(f"| {n} | {arm} | " + ", ".join(f"{r:.4f}" for r in ratios) + " |")
    return "\n".join(lines) + "\n"


def _per_seed(values: dict[int, float], met: Callable[[float], bool], digits: int) -> str:
    """Each seed's figure, marked met or missed; '-' where the cell was not run."""
    if not values:
        return "-"
    return ", ".join(f"{values[s]:.{digits}f} {'met' if met(values[s]) else 'MISSED'}"
                     for s in sorted(values))


def floors_table(results: list[dict[str, Any]]) -> str:
    """Every floor for every arm, per seed (seeds in order): met or missed."""
    noisy, base = _by(results, "noisy"), _by(results, "noisy-base")
    equal, weighted = _by(results, "equal-weights"), _by(results, "weighted")
    solo = _by(results, "solo")
    lines = ["| replicas | arm | noisy: b p99 / base (<= 1.5) | equal weights: Jain (>= 0.95) "
             "| 1:2:4: worst share error (<= 0.10) | solo: / fcfs throughput (>= 0.97) |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(n, arm) for n, arm, _ in (*noisy, *equal, *weighted, *solo)})
    for n, arm in keys:
        ratio = {s: c["tenants"]["b"]["ttft_p99_s"] / base[(n, arm, s)]["tenants"]["b"]["ttft_p99_s"]
                 for (m, a, s), c in noisy.items() if (m, a) == (n, arm) and (m, a, s) in base}
        jain = {s: c["jain_weighted_tokens"] for (m, a, s), c in equal.items() if (m, a) == (n, arm)}
        worst = {s: max(abs(e) for e in c["share_errors"].values())
                 for (m, a, s), c in weighted.items() if (m, a) == (n, arm)}
        alone = {s: c["throughput_tok_s"] / solo[(n, "fcfs", s)]["throughput_tok_s"]
                 for (m, a, s), c in solo.items()
                 if (m, a) == (n, arm) and arm != "fcfs" and (m, "fcfs", s) in solo}
        lines.append(f"| {n} | {arm} | {_per_seed(ratio, lambda r: r <= 1.5, 2)} | "
                     f"{_per_seed(jain, lambda j: j >= 0.95, 3)} | "
                     f"{_per_seed(worst, lambda e: e <= 0.10, 3)} | "
                     f"{_per_seed(alone, lambda r: r >= 0.97, 4)} |")
    return "\n".join(lines) + "\n"


def report(results: list[dict[str, Any]]) -> str:
    seeds = sorted({r["seed"] for r in results})
    duration = sorted({r["duration_s"] for r in results})
    cpu = sum(r["cpu_s"] for r in results)
    return "\n".join([
        "# Tenant fairness in the simulated cluster (issue 43)",
        "",
        f"Every GPU figure is simulated (the cost model: Llama-3-8B on H100), none measured. "
        f"Seeds {seeds}, {duration} virtual s of arrivals a cell, iterserve's router; "
        f"{len(results)} cells, {cpu:.0f} CPU s. Figures: median (min-max) over the seeds.",
        "",
        "## Every floor, every arm, per seed", "",
        floors_table(results),
        "## Noisy neighbour: b's p99 TTFT when a sends 10x b's rate (1.5x capacity) over "
        "b's p99 when a sends its equal-weight share (0.5x capacity), same arm, same seed",
        "", noisy_table(results),
        "## Backlogged, equal weights 1:1:1, rates 0.5x / 1x / 2x capacity "
        "(Jain floor >= 0.95)", "",
        backlogged_table(results, "equal-weights"),
        "## Backlogged, weights 1:2:4 (shares within 10 %)", "",
        backlogged_table(results, "weighted"),
        "## One tenant alone at 1.5x capacity (work conservation)", "",
        solo_table(results),
    ])
