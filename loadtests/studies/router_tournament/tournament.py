"""The routing and autoscaling tournament on the cluster simulator.

    python -m iterserve.loadtests.studies.router_tournament.tournament [--jobs 2] [--estimate] \
        [--quick] [--seed S]
        [--only routers|big|sensitivity|autoscalers] [--workloads ...] [--sizes ...]
        [--loads ...] [--routers ...] [--out DIR] [--capacity-from STORE]
    python -m iterserve.loadtests.studies.router_tournament.tournament --trace FILE [--trace-speeds 1 2]
        [--trace-loads 0.5 0.8 0.95]
        [--sizes ...] [--routers ...] [--hash-block-size N] [--max-model-len N]
        [--jobs 2] [--out DIR]

With no --only, the issue's whole matrix in one command (`--estimate` prints its cells and
CPU time and stops):

- routers: every workload at 8 and 32 replicas, loads 50 / 80 / 95 % of capacity
  (`tournament_cells.probe_capacity`: what the cluster sustains with round-robin);
- big: multi-tenant and chat-summarise at 64 and 128 replicas, the same loads;
- sensitivity: every workload at 8 replicas and 80 % with every cost-model coefficient
  halved and doubled (capacity re-probed, the SLO scaled with the factor: see
  `tournament_cells.slo_scale`);
- autoscalers: the diurnal trace with its 3x spike (reached in 10 s) at mean loads 0.4 and
  0.8 of 8 replicas' capacity, 360 s (spike at 240 s) and 600 s (spike at 400 s), seeds 0-2.

Router cells run for max(MIN_DURATION_S[replicas], MIN_REQUESTS / rate) virtual seconds:
at least 2,000 requests, so a p99 has ~20 samples above it and a bootstrap interval, and at
least a minute at 8 replicas (fewer seconds for more replicas, where requests are many and
the routers' caches warm faster). Per cell: p50/p99 TTFT with bootstrap 95 % intervals,
p99 ITL, throughput, goodput (TTFT <= 2 s, ITL p99 <= 100 ms) with its interval,
preemptions, prefix-cache hit rate, CPU seconds; autoscalers add GPU-hours, SLO attainment
and replicas over time. Results merge into DIR/tournament.json (cells keyed, so partial runs
add up and a rerun skips what is there) and are rendered to tournament.md and
tournament_*.png.

--quick: 8 replicas, 60 virtual s, one workload (skewed-bursts) at one fixed rate, every
router; the CI smoke test (tests/unit/test_tournament_quick.py) runs it.

--seed S draws the workloads and the simulator's randomness from S (0: the seed
tournament.md judges); `--seed 1 --capacity-from results/tournament.json --out DIR` runs
seed 1's cells at seed 0's rates, and `tournament_seeds` judges the floors seed by seed.

--trace FILE replays a recorded trace (`sim/traces.py`: our JSONL, Mooncake's JSONL or
Azure's CSV) in place of the generated workloads: every router at every --sizes, once per
--trace-speeds factor (1: as recorded; 2: every arrival time halved, the same requests at
twice the rate) and once per --trace-loads fraction of the trace's capacity (probed as the
generated workloads' is, over the trace's first 120 s sped up), judged by the same floors.
Results go to DIR/tournament_<trace name>.json and .md, apart from the generated matrix; a
cell is keyed by the file's sha256, so an edited trace runs again. A p99 needs the trace to
hold a few thousand requests: the report says how many each cell had.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.shapes import WORKLOADS
from iterserve.autoscale.sim.traces import read_trace, trace_digest
from iterserve.loadtests.studies import results_of
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    AUTOSCALERS,
    ROUTERS,
    probe_capacity,
    probe_trace_capacity,
    run_cell,
)
from iterserve.loadtests.studies.router_tournament.tournament_estimate import print_estimate

SIZES = (8, 32)
BIG_SIZES = (64, 128)
BIG_WORKLOADS = ("multi-tenant", "chat-summarise")
LOADS = (0.5, 0.8, 0.95)
MIN_REQUESTS = 2000  # enough for a p99 with ~20 samples above it
MIN_DURATION_S = {8: 60.0, 32: 30.0, 64: 20.0, 128: 15.0}
SENSITIVITY = ({"*": 0.5}, {"*": 2.0})
SENSITIVITY_SIZE, SENSITIVITY_LOAD = 8, 0.8
AUTOSCALE_LOADS = (0.4, 0.8)
AUTOSCALE_DURATIONS_S = (360.0, 600.0)
AUTOSCALE_SEEDS = (0, 1, 2)
QUICK_RATE = 12.0
CELL_KEYS = ("kind", "workload", "replicas", "load", "router", "autoscaler", "cost_scale",
             "seed", "duration_s")
# keyed only where present, so that the generated workloads' cells keep their stored keys
TRACE_KEYS = ("trace_sha256", "speed", "hash_block_size", "max_model_len", "startup_delay_s")


def cell_key(cell: dict[str, Any]) -> str:
    key = {k: cell.get(k) for k in CELL_KEYS}
    key.update({k: cell[k] for k in TRACE_KEYS if k in cell})
    return json.dumps(key, sort_keys=True)


def capacities(workloads: Sequence[str], cost_scale: dict[str, float] | None,
               cache: dict[str, float]) -> dict[str, float]:
    out = {}
    for name in workloads:
        key = json.dumps([name, cost_scale], sort_keys=True)
        if key not in cache:
            t = time.time()
            cache[key] = probe_capacity(name, cost_scale)
            print(f"capacity {name} {cost_scale or ''}: {cache[key]:.2f} req/s per replica "
                  f"({time.time() - t:.0f}s)", flush=True)
        out[name] = cache[key]
    return out


def cell_duration_s(replicas: int, rate: float) -> float:
    """Virtual seconds for a router cell: MIN_REQUESTS requests, and at least
    MIN_DURATION_S for its size (15 s for sizes not listed)."""
    return max(MIN_DURATION_S.get(replicas, 15.0), MIN_REQUESTS / rate)


def router_cells(workloads: Sequence[str], sizes: Sequence[int], loads: Sequence[float],
                 routers: Sequence[str], caps: dict[str, float], seed: int,
                 cost_scale: dict[str, float] | None = None, kind: str = "router",
                 fixed_duration_s: float | None = None) -> list[dict[str, Any]]:
    cells = []
    for workload in workloads:
        for n in sizes:
            for load in loads:
                rate = load * caps[workload] * n
                duration = fixed_duration_s or cell_duration_s(n, rate)
                for router in routers:
                    cells.append({"kind": kind, "workload": workload, "replicas": n,
                                  "load": load, "rate": rate, "duration_s": duration,
                                  "router": router, "seed": seed, "cost_scale": cost_scale})
    return cells


def trace_cells(path: Path, sizes: Sequence[int], routers: Sequence[str], seed: int,
                speeds: Sequence[float] = (), loads: Sequence[float] = (),
                capacity: dict[str, float] | None = None, hash_block_size: int | None = None,
                max_model_len: int | None = None) -> list[dict[str, Any]]:
    """Router cells replaying the trace at `path` at every size: once per speed (arrival
    times divided by it) and once per load (the speed that offers that fraction of the
    trace's capacity, probed once with round-robin and kept in `capacity`). The trace is
    read here once, to name its rate and span (and to fail before any cell runs: also on a
    request longer than the replicas' max_model_len, which the simulator would reject)."""
    requests = read_trace(path, hash_block_size)
    limit = max_model_len or ClusterSimConfig().max_model_len
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    if longest > limit:
        raise ValueError(f"a request of {longest} tokens (prompt + output) exceeds "
                         f"max_model_len {limit}: pass --max-model-len")
    span = max(r.arrival_time for r in requests) or 1.0
    trace_rate = len(requests) / span
    digest = trace_digest(path)
    runs: list[tuple[str, float | None, float]] = [
        (f"{path.stem} x{speed:g}", None, speed) for speed in speeds]
    if loads:
        key = json.dumps([f"trace {path.stem} ({digest[:12]}, max_model_len "
                          f"{max_model_len}, hash block {hash_block_size})", None])
        if capacity is None:
            capacity = {}
        if key not in capacity:
            capacity[key] = probe_trace_capacity(requests, max_model_len)
            print(f"capacity {path.stem}: {capacity[key]:.3f} req/s per replica", flush=True)
        per_replica = capacity[key]
    extra = {} if max_model_len is None else {"max_model_len": max_model_len}
    cells = []
    for n in sizes:
        sized = runs + [(path.stem, load, load * per_replica * n / trace_rate)
                        for load in loads]
        for workload, load, speed in sized:
            for router in routers:
                cells.append({"kind": "trace", "workload": workload, "trace": str(path),
                              "trace_sha256": digest, "speed": speed,
                              "hash_block_size": hash_block_size, "replicas": n,
                              "load": load, "rate": trace_rate * speed,
                              "duration_s": span / speed, "router": router, "seed": seed,
                              "cost_scale": None, **extra})
    return cells


def autoscaler_cells(cap: float, seed: int, load: float,
                     duration_s: float) -> list[dict[str, Any]]:
    """Diurnal at a mean rate that 8 replicas carry at `load`; the spike needs ~3x that.
    Every autoscaler starts from 8 replicas; the static arms are 8 and the spike's need."""
    rate = load * cap * 8
    peak_need = math.ceil(3 * rate / (0.8 * cap))
    cells = []
    for name in AUTOSCALERS:
        cells.append({"kind": "autoscaler", "workload": "diurnal", "replicas": 8,
                      "rate": rate, "duration_s": duration_s, "router": "iterserve",
                      "autoscaler": name, "min_replicas": 2, "max_replicas": 2 * peak_need,
                      "seed": seed, "cost_scale": None, "load": load})
    cells.append({**cells[0], "replicas": peak_need, "autoscaler": "fixed",
                  "label": f"fixed-{peak_need}"})
    cells[0]["label"] = "fixed-8"
    return cells


def run_all(cells: list[dict[str, Any]], jobs: int, store: dict[str, Any], out: Path) -> None:
    todo = [c for c in cells if cell_key(c) not in store["cells"]]
    print(f"{len(todo)} cells to run ({len(cells) - len(todo)} already in {out.name})",
          flush=True)
    if not todo:
        return
    # longest first, so the last worker is not left alone with a big cell
    todo.sort(key=lambda c: -c["duration_s"] * c["replicas"] * c["rate"])
    t0 = time.time()
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(jobs) as pool:
        for i, result in enumerate(pool.imap_unordered(run_cell, todo), 1):
            store["cells"][cell_key(result)] = result
            print(f"[{i}/{len(todo)} {time.time() - t0:6.0f}s] {result['kind']} "
                  f"{result['workload']} n={result['replicas']} load={result['load']} "
                  f"{result.get('autoscaler') or result['router']}: p99 TTFT "
                  f"{result['ttft_p99_s'][0]:.3f}s goodput {result['goodput_rps'][0]:.1f} "
                  f"({result['cpu_s']:.0f} CPU s)", flush=True)
            out.write_text(json.dumps(store, indent=1, sort_keys=True))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the CI smoke run: 8 replicas, 60 virtual s, one workload, every router")
    p.add_argument("--estimate", action="store_true",
                   help="print the cells to run and their estimated CPU time, run nothing")
    p.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    p.add_argument("--seed", type=int, default=0,
                   help="workload and simulator seed (0: the seed tournament.md judges)")
    p.add_argument("--only", choices=("routers", "big", "sensitivity", "autoscalers"),
                   action="append", help="run only these parts of the matrix (repeatable)")
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS),
                   help="workloads of the router cells")
    p.add_argument("--sizes", nargs="*", type=int, default=list(SIZES),
                   help="replica counts of the router cells")
    p.add_argument("--loads", nargs="*", type=float, default=list(LOADS),
                   help="loads (fractions of capacity) of the router cells")
    p.add_argument("--routers", nargs="*", default=list(ROUTERS), help="routers to run")
    p.add_argument("--duration", type=float, default=None,
                   help="virtual seconds per router cell (default: enough for "
                   f"{MIN_REQUESTS} requests, at least {MIN_DURATION_S[8]:.0f} s at 8 replicas)")
    p.add_argument("--big-workloads", nargs="*", default=list(BIG_WORKLOADS),
                   help="workloads of the 64- and 128-replica cells")
    p.add_argument("--big-sizes", nargs="*", type=int, default=list(BIG_SIZES),
                   help="replica counts of the big cells")
    p.add_argument("--big-loads", nargs="*", type=float, default=list(LOADS),
                   help="loads of the big cells")
    p.add_argument("--sensitivity-workloads", nargs="*", default=list(WORKLOADS),
                   help="workloads run with the cost model scaled x0.5 and x2")
    p.add_argument("--autoscale-loads", nargs="*", type=float, default=list(AUTOSCALE_LOADS),
                   help="diurnal mean rates as fractions of 8 replicas' capacity")
    p.add_argument("--autoscale-durations", nargs="*", type=float,
                   default=list(AUTOSCALE_DURATIONS_S), help="virtual seconds of the autoscaler cells")
    p.add_argument("--autoscale-seeds", nargs="*", type=int, default=list(AUTOSCALE_SEEDS),
                   help="seeds of the autoscaler cells")
    p.add_argument("--out", type=Path, default=results_of("router_tournament"),
                   help="folder for the store (.json), the report (.md) and the plots")
    p.add_argument("--capacity-from", type=Path, default=None,
                   help="take the capacities this store probed (another seed's cells then "
                   "run at the same rates)")
    p.add_argument("--trace", type=Path, default=None,
                   help="replay this trace (JSONL or CSV) at every --sizes and --trace-speeds "
                   "in place of the generated workloads")
    p.add_argument("--trace-speeds", nargs="*", type=float, default=None,
                   help="with --trace: arrival-rate factors (2: arrivals twice as fast); "
                   "default 1 unless --trace-loads is given")
    p.add_argument("--trace-loads", nargs="*", type=float, default=[],
                   help="with --trace: also replay at these fractions of the trace's "
                   "capacity (probed with round-robin, as for the generated workloads)")
    p.add_argument("--hash-block-size", type=int, default=None,
                   help="with --trace: tokens per hash id (default: the trace's, else 16)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="with --trace: the replicas' context length (default: the "
                   "simulator's, 8192), for traces with longer requests")
    return p


def _check_trace_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.trace is None:
        return
    if args.quick or args.only or args.capacity_from is not None:
        parser.error("--trace replays one trace: it takes no --quick, --only or "
                     "--capacity-from")
    if not args.trace.is_file():
        parser.error(f"--trace: no such file: {args.trace}")
    if args.trace_speeds is None:
        args.trace_speeds = [] if args.trace_loads else [1.0]
    if any(not k > 0 for k in args.trace_speeds + args.trace_loads):
        parser.error("--trace-speeds and --trace-loads take factors > 0")
    if not args.trace_speeds and not args.trace_loads:
        parser.error("--trace: give --trace-speeds or --trace-loads")


def matrix_cells(args: argparse.Namespace, store: dict[str, Any]) -> list[dict[str, Any]]:
    parts = args.only or ["routers", "big", "sensitivity", "autoscalers"]
    cells: list[dict[str, Any]] = []
    if "routers" in parts:
        caps = capacities(args.workloads, None, store["capacity"])
        cells += router_cells(args.workloads, args.sizes, args.loads, args.routers, caps,
                              args.seed, fixed_duration_s=args.duration)
    if "big" in parts:
        caps = capacities(args.big_workloads, None, store["capacity"])
        cells += router_cells(args.big_workloads, args.big_sizes, args.big_loads,
                              args.routers, caps, args.seed, fixed_duration_s=args.duration)
    if "sensitivity" in parts:
        for scale in SENSITIVITY:
            names = args.sensitivity_workloads
            scaled = capacities(names, scale, store["capacity"])
            cells += router_cells(names, [SENSITIVITY_SIZE], [SENSITIVITY_LOAD], args.routers,
                                  scaled, args.seed, scale, kind="sensitivity",
                                  fixed_duration_s=args.duration)
    if "autoscalers" in parts:
        cap = capacities(["diurnal"], None, store["capacity"])["diurnal"]
        for load in args.autoscale_loads:
            for duration in args.autoscale_durations:
                for seed in args.autoscale_seeds:
                    cells += autoscaler_cells(cap, seed, load, duration)
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_trace_args(parser, args)
    from iterserve.loadtests.studies.router_tournament.tournament_report import write_report

    args.out.mkdir(parents=True, exist_ok=True)
    stem = ("tournament_quick" if args.quick else
            f"tournament_{args.trace.stem}" if args.trace is not None else "tournament")
    path = args.out / f"{stem}.json"
    store = json.loads(path.read_text()) if path.exists() else {}
    store.setdefault("cells", {})
    store.setdefault("capacity", {})
    store.setdefault("commands", [])
    if args.capacity_from is not None:
        probed = json.loads(args.capacity_from.read_text()).get("capacity", {})
        store["capacity"] = {**probed, **store["capacity"]}
    if args.quick:
        cells = [{"kind": "router", "workload": "skewed-bursts", "replicas": 8, "load": None,
                  "rate": QUICK_RATE, "duration_s": 60.0, "router": r, "seed": args.seed,
                  "cost_scale": None} for r in args.routers]
    elif args.trace is not None:
        try:
            cells = trace_cells(args.trace, args.sizes, args.routers, args.seed,
                                args.trace_speeds, args.trace_loads, store["capacity"],
                                args.hash_block_size, args.max_model_len)
        except ValueError as error:
            parser.error(f"--trace: {error}")
    else:
        cells = matrix_cells(args, store)
    if args.estimate:
        path.write_text(json.dumps(store, indent=1, sort_keys=True))  # keep the probes
        todo = [c for c in cells if cell_key(c) not in store["cells"]]
        print_estimate(todo, list(store["cells"].values()), args.jobs)
        return 0
    command = "python -m iterserve.loadtests.studies.router_tournament.tournament " + " ".join(
        sys.argv[1:] if argv is None else argv)
    if command not in store["commands"]:
        store["commands"].append(command)
    path.write_text(json.dumps(store, indent=1, sort_keys=True))
    run_all(cells, args.jobs, store, path)
    write_report(store, args.out, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
