"""A lower bound on a tournament cell's p99 TTFT that no router can beat.

Every request must prefill the part of its prompt no replica has cached. At best (an idle
replica that holds every block any earlier request could have left), request i's TTFT is
the time one replica takes to prefill its prompt alone, given its shared prefix cached if
an earlier request of the run carried the same prefix, nothing cached otherwise. Each
request's real TTFT is at least that, whatever the router does: sharing steps with other
requests only adds to a step's time, and the token budget only splits the prefill over more
steps. Percentiles are monotone in each value, so the percentile of these per-request
bounds bounds the cell's own percentile from below.

The idle TTFTs come from the simulator itself (one replica, the cell's cost model and
engine settings, the prefix warmed by a request of its own), not from a formula, so the
chunking, the fixed step cost and the attention reads are the production scheduler's.

    python -m iterserve.loadtests.studies.prefill_bound.prefill_bound --workload multi-tenant --replicas 8 \
        --load 0.5 [--cost-scale 2] [--tournament loadtests/studies/router_tournament/results/tournament.json]

prints the bound beside each router's p99 from the tournament JSON and the floor
"2x better than pow2", i.e. pow2's p99 / 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.sim.baseline_routers import RoundRobinRouter
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.prompts import SyntheticPrompt
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tournament_cells import sim_config

WARM_GAP_S = 10.0  # the warming request has long finished when the measured one arrives
UNIQUE_BASE = 1 << 40  # token ids no workload prompt uses


def shared_prefix(prompt: Sequence[int]) -> tuple[int, ...]:
    """The prompt's shared head (a tenant's context, a system prompt); () if none."""
    return prompt.prefix if isinstance(prompt, SyntheticPrompt) else ()


def idle_ttft(config: ClusterSimConfig, cached: int, total: int) -> float:
    """TTFT of a `total`-token prompt alone on one replica, its first `cached` tokens in
    that replica's prefix cache (warmed by an earlier request of `cached` tokens)."""
    prefix = tuple(range(UNIQUE_BASE, UNIQUE_BASE + cached))
    measured = WorkloadRequest("measured", WARM_GAP_S if cached else 0.0,
                          SyntheticPrompt(prefix, UNIQUE_BASE + cached, total - cached), 1)
    requests = [WorkloadRequest("warm", 0.0, prefix, 1), measured] if cached else [measured]
    result = simulate(requests, [RoundRobinRouter()], 1, config)
    (record,) = [r for r in result.records if r.request_id == "measured"]
    if record.ttft is None:
        raise RuntimeError(f"the idle replica never answered a {total}-token prompt")
    return record.ttft


def per_request_bounds(requests: Sequence[WorkloadRequest], config: ClusterSimConfig) -> list[float]:
    """Each request's best possible TTFT (see the module docstring), in arrival order."""
    seen: set[int] = set()
    block = config.block_size
    memo: dict[tuple[int, int], float] = {}  # (cached, total) -> idle TTFT
    out = []
    for request in sorted(requests, key=lambda r: r.arrival_time):
        prefix = shared_prefix(request.prompt_token_ids)
        key = id(prefix)  # the workloads hand every request of a tenant the same tuple
        # only whole blocks are cached, and the last prompt token is always computed
        cacheable = min(len(prefix), len(request.prompt_token_ids) - 1) // block * block
        cached = cacheable if prefix and key in seen else 0
        if prefix:
            seen.add(key)
        key_len = (cached, len(request.prompt_token_ids))
        if key_len not in memo:
            memo[key_len] = idle_ttft(config, *key_len)
        out.append(memo[key_len])
    return out


def cold_prefixes(requests: Sequence[WorkloadRequest]) -> int:
    """How many requests are the first of their shared prefix (a miss on any router)."""
    return len({id(shared_prefix(r.prompt_token_ids)) for r in requests
                if shared_prefix(r.prompt_token_ids)})


def find_cells(store: dict[str, Any], workload: str, replicas: int, load: float,
               cost_scale: float | None) -> dict[str, dict[str, Any]]:
    """The tournament's cells of (workload, replicas, load, cost scale), by router."""
    want = None if cost_scale is None else {"*": cost_scale}
    out = {}
    for cell in store["cells"].values():
        if (cell["workload"], cell["replicas"], cell.get("autoscaler")) != (
                workload, replicas, None):
            continue
        if abs(cell["load"] - load) > 1e-9 or cell.get("cost_scale") != want:
            continue
        out[cell["router"]] = cell
    return out


def bound_report(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bound for the cell all `cells` share (workload, rate, duration, seed, costs)."""
    any_cell = next(iter(cells.values()))
    config = sim_config(any_cell.get("cost_scale"), any_cell["seed"])
    requests = make(any_cell["workload"], any_cell["rate"], any_cell["duration_s"],
                    any_cell["seed"])
    bounds = per_request_bounds(requests, config)
    p99_bound = percentile(bounds, 99)
    routers = {name: cell["ttft_p99_s"] for name, cell in sorted(cells.items())}
    pow2 = routers.get("pow2")
    return {
        "workload": any_cell["workload"], "replicas": any_cell["replicas"],
        "load": any_cell["load"], "cost_scale": any_cell.get("cost_scale"),
        "requests": len(requests), "cold_prefix_requests": cold_prefixes(requests),
        "ttft_p50_bound_s": percentile(bounds, 50), "ttft_p99_bound_s": p99_bound,
        "ttft_p99_s": routers,
        "floor_2x_pow2_s": None if pow2 is None else pow2[0] / 2.0,
    }


def render(report: dict[str, Any]) -> str:
    lines = [f"{report['workload']} / {report['replicas']} replicas / load {report['load']}"
             f" / cost {report['cost_scale'] or 'x1'}: {report['requests']} requests, "
             f"{report['cold_prefix_requests']} the first of their shared prefix",
             f"p99 TTFT bound (no router below it): {report['ttft_p99_bound_s']:.4f} s "
             f"(p50 bound {report['ttft_p50_bound_s']:.4f} s)"]
    if report["floor_2x_pow2_s"] is not None:
        floor = report["floor_2x_pow2_s"]
        verdict = "reachable" if floor >= report["ttft_p99_bound_s"] else "BELOW THE BOUND"
        lines.append(f"floor '2x better than pow2' asks p99 <= {floor:.4f} s: {verdict}")
    lines.append("| router | p99 TTFT (s) [95 % interval] | / bound |")
    lines.append("|---|---|---|")
    for name, (p99, lo, hi) in report["ttft_p99_s"].items():
        lines.append(f"| {name} | {p99:.4f} [{lo:.4f}, {hi:.4f}] | "
                     f"{p99 / report['ttft_p99_bound_s']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="multi-tenant", help="the tournament workload of the cell")
    p.add_argument("--replicas", type=int, default=8, help="the cell's replicas")
    p.add_argument("--load", type=float, default=0.5, help="the cell's load (fraction of capacity)")
    p.add_argument("--cost-scale", type=float, default=None,
                   help="every cost coefficient times this (a sensitivity cell)")
    p.add_argument("--tournament", type=Path, default=results_of("router_tournament") / "tournament.json",
                   help="the tournament store whose capacities and cells it reads")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    cells = find_cells(json.loads(args.tournament.read_text()), args.workload,
                       args.replicas, args.load, args.cost_scale)
    if not cells:
        raise SystemExit(f"no cell {args.workload}/{args.replicas}/{args.load} "
                         f"cost {args.cost_scale} in {args.tournament}")
    report = bound_report(cells)
    print(render(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

