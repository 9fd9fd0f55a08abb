"""The multi-tenant tournament cells with tenant cache salting off and on (issue 42).

    python -m iterserve.loadtests.studies.router_tournament.tenant_salting [--jobs 2] \
        [--sizes 8] [--loads 0.5 0.8 0.95] [--routers ...]

Each cell of the tournament's multi-tenant workload (its rate from the stored capacity
probe, results/tournament.json) runs twice in this one command, with the workload as
generated (every tenant in the shared cache namespace: the tournament's published cells)
and salted by tenant (`sim/tenant_salt.py`: what the ingress does by default since
tenants), so the two columns compare on the same code. Writes
results/tenant_salting.json and .md.

--system-prompt-tokens N runs a variant where salting can matter: every tenant's prompt
starts with the same N-token system prompt (then its own context and question, at the
published cells' rates), three ways: one shared namespace, salted by tenant, and salted
with every tenant granted one cache_share group (which must equal the first). Written to
results/tenant_salting_system_prompt.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.prompts import SyntheticPrompt
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.tenant_salt import salted_by_tenant
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tournament import LOADS, router_cells
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    NUM_INGRESS_ROUTERS,
    ROUTERS,
    run_cell,
    sim_config,
    summarise,
)

WORKLOAD = "multi-tenant"
# The tournament's published contestants (its README's commands).
PUBLISHED_ROUTERS = ("pow2", "least-kv", "llm-d", "llm-d-precise", "dynamo", "ray-prefix",
                     "sglang", "iterserve")


def cells_both_ways(sizes: Sequence[int], loads: Sequence[float], routers: Sequence[str],
                    capacity: float) -> list[dict[str, Any]]:
    plain = router_cells([WORKLOAD], sizes, loads, routers, {WORKLOAD: capacity}, seed=0)
    return [{**cell, "tenant_cache_isolation": salted} for cell in plain
            for salted in (False, True)]


def with_system_prompt(requests: list[WorkloadRequest], tokens: int) -> list[WorkloadRequest]:
    """Every prompt headed by the same `tokens`-token system prompt (ids below the tenants'
    contexts); each tenant's new head is one tuple, shared by its requests."""
    system = tuple(range((1 << 28), (1 << 28) + tokens))
    heads: dict[int, tuple[int, ...]] = {}
    out = []
    for request in requests:
        prompt = request.prompt_token_ids
        if not isinstance(prompt, SyntheticPrompt):
            raise ValueError("the multi-tenant shape's prompts are synthetic")
        head = heads.setdefault(id(prompt.prefix), system + prompt.prefix)
        out.append(dataclasses.replace(request, prompt_token_ids=SyntheticPrompt(
            head, prompt.unique_start, prompt.num_unique, prompt.private)))
    return out


def run_system_prompt_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """run_cell's figures for the multi-tenant workload with a shared system prompt, in the
    cell's namespace mode: "shared", "salted" or "granted"."""
    requests = with_system_prompt(
        make(WORKLOAD, cell["rate"], cell["duration_s"], cell["seed"]),
        cell["system_prompt_tokens"])
    if cell["namespaces"] != "shared":
        grant = {r.tenant: "all" for r in requests if r.tenant} \
            if cell["namespaces"] == "granted" else None
        requests = salted_by_tenant(requests, grant)
    routers = [ROUTERS[cell["router"]]() for _ in range(NUM_INGRESS_ROUTERS)]
    result = simulate(requests, routers, cell["replicas"], sim_config(None, cell["seed"]))
    return {**cell, **summarise(result, cell["seed"])}


def system_prompt_table(results: list[dict[str, Any]]) -> str:
    by_key = {(r["replicas"], r["load"], r["router"], r["namespaces"]): r for r in results}
    lines = ["| replicas | load | router | p99 TTFT shared / salted / granted (s) | "
             "hit rate shared / salted / granted |", "|---|---|---|---|---|"]
    for (n, load, router, mode), shared in sorted(by_key.items()):
        if mode != "shared":
            continue
        rows = [shared, by_key[(n, load, router, "salted")],
                by_key[(n, load, router, "granted")]]
        lines.append(f"| {n} | {load} | {router} | "
                     + " / ".join(f"{r['ttft_p99_s'][0]:.3f}" for r in rows) + " | "
                     + " / ".join(f"{r['prefix_hit_rate']:.4f}" for r in rows) + " |")
    return "\n".join(lines) + "\n"


def table(results: list[dict[str, Any]]) -> str:
    """One row per (size, load, router): p50 / p99 TTFT and prefix-cache hit rate, off and
    on, and whether the on cell's figures equal the off cell's."""
    by_key = {(r["replicas"], r["load"], r["router"], r["tenant_cache_isolation"]): r
              for r in results}
    lines = ["| replicas | load | router | p99 TTFT off / on (s) | p50 TTFT off / on (s) | "
             "hit rate off / on | identical |", "|---|---|---|---|---|---|---|"]
    for (n, load, router, salted), off in sorted(by_key.items()):
        if salted:
            continue
        on = by_key[(n, load, router, True)]
        same = all(off[k] == on[k] for k in ("ttft_p50_s", "ttft_p99_s", "prefix_hit_rate",
                                               "throughput_tok_s", "preemptions"))
        lines.append(f"| {n} | {load} | {router} | {off['ttft_p99_s'][0]:.3f} / "
                     f"{on['ttft_p99_s'][0]:.3f} | {off['ttft_p50_s'][0]:.3f} / "
                     f"{on['ttft_p50_s'][0]:.3f} | {off['prefix_hit_rate']:.4f} / "
                     f"{on['prefix_hit_rate']:.4f} | {'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    parser.add_argument("--sizes", nargs="*", type=int, default=[8], help="replica counts")
    parser.add_argument("--loads", nargs="*", type=float, default=list(LOADS),
                        help="fractions of the probed capacity")
    parser.add_argument("--routers", nargs="*", choices=list(ROUTERS),
                        default=list(PUBLISHED_ROUTERS), help="routers to run")
    parser.add_argument("--system-prompt-tokens", type=int, default=0,
                        help="run the shared-system-prompt variant with this many tokens")
    parser.add_argument("--out", type=Path, default=results_of("router_tournament"),
                        help="folder of tournament.json and the outputs")
    args = parser.parse_args(argv)
    store = json.loads((args.out / "tournament.json").read_text())
    capacity = store["capacity"][json.dumps([WORKLOAD, None])]
    if args.system_prompt_tokens > 0:
        plain = router_cells([WORKLOAD], args.sizes, args.loads, args.routers,
                             {WORKLOAD: capacity}, seed=0)
        variant = [{**c, "system_prompt_tokens": args.system_prompt_tokens, "namespaces": mode}
                   for c in plain for mode in ("shared", "salted", "granted")]
        with multiprocessing.Pool(args.jobs) as pool:
            results = pool.map(run_system_prompt_cell, variant)
        stem = "tenant_salting_system_prompt"
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        text = system_prompt_table(results)
        (args.out / f"{stem}.md").write_text(text)
        print(text)
        return 0
    cells = cells_both_ways(args.sizes, args.loads, args.routers, capacity)
    with multiprocessing.Pool(args.jobs) as pool:
        results = pool.map(run_cell, cells)
    (args.out / "tenant_salting.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (args.out / "tenant_salting.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
