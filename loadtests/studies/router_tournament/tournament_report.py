"""Render tournament.json to markdown: the floor matrix, per-cell tables, sensitivity and
autoscalers (plots: `tournament_plots`).

Floors (the issue): in every router cell iterserve has the best or within 5 % of the best
p99 TTFT and goodput of all routers (by point estimate; a miss inside overlapping intervals
is marked so), and on multi-tenant at least 2x better p99 TTFT than power-of-two. "All
routers" are the baselines and iterserve; other iterserve variants (iterserve-nocache) are
shown but not counted as the best. Sensitivity cells are judged on goodput under the SLO
scaled with the cost factor (`tournament_cells.slo_scale`), the unscaled figure beside it.
The autoscaler meets the TTFT SLO for >= 99 % of requests with no more GPU-hours than the
cheapest baseline that also meets it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from iterserve.loadtests.studies.router_tournament.tournament_plots import write_plots
from iterserve.loadtests.studies.router_tournament.tournament_stats import Interval, best_of, within

OURS = "iterserve"
TOLERANCE = 0.05
POW2_FACTOR_FLOOR = 2.0
POW2_FLOOR_WORKLOADS = ("multi-tenant",)
SLO_ATTAINMENT_FLOOR = 0.99
FEW_REQUESTS = 1000  # below this a cell's p99 rests on fewer than ten requests


def _iv(values: list[float]) -> Interval:
    return Interval(*values)


def _fmt(values: list[float], digits: int = 3) -> str:
    v, lo, hi = values
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _scale_txt(scale: str) -> str:
    return "" if scale == "null" else f", cost x {scale}"


def group_cells(cells: list[dict[str, Any]], kind: str) -> dict[tuple, list[dict[str, Any]]]:
    """Cells by (workload, replicas, load, cost scale); where a router ran a cell twice
    (an imported older run and this one's own), this run's, then the longer, counts."""
    chosen: dict[tuple, dict[str, Any]] = {}
    for c in cells:
        if c["kind"] != kind:
            continue
        scale = json.dumps(c.get("cost_scale"), sort_keys=True)
        key = (c["workload"], c["replicas"], c["load"], scale, c["router"])
        rank = ("imported_from" not in c, c["duration_s"])
        old = chosen.get(key)
        if old is None or rank > ("imported_from" not in old, old["duration_s"]):
            chosen[key] = c
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for key, c in chosen.items():
        groups[key[:4]].append(c)
    return groups


def _counted(name: str) -> bool:
    return name == OURS or not name.startswith(OURS + "-")


def floor_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where iterserve stands in one cell: best by point estimate, within 5 %, whether a
    difference is significant (intervals apart), pow2's p99 over ours."""
    p99 = {r["router"]: _iv(r["ttft_p99_s"]) for r in rows if _counted(r["router"])}
    good = {r["router"]: _iv(r["goodput_rps"]) for r in rows if _counted(r["router"])}
    best_p99, p99_ties = best_of(p99, lower_is_better=True)
    best_good, good_ties = best_of(good, lower_is_better=False)
    out: dict[str, Any] = {"best_p99": best_p99, "p99_ties": sorted(p99_ties),
                           "best_goodput": best_good, "goodput_ties": sorted(good_ties),
                           "routers": len(p99)}
    if OURS in p99:
        out["p99_within_5pct"] = within(p99[OURS].value, p99[best_p99].value, TOLERANCE, True)
        out["p99_not_significantly_worse"] = OURS in p99_ties
        out["goodput_within_5pct"] = within(good[OURS].value, good[best_good].value,
                                            TOLERANCE, False)
        out["goodput_not_significantly_worse"] = OURS in good_ties
    if OURS in p99 and "pow2" in p99 and p99[OURS].value > 0:
        out["pow2_over_ours_p99"] = p99["pow2"].value / p99[OURS].value
    return out


def misses(workload: str, check: dict[str, Any]) -> list[str]:
    """The floors iterserve misses in a cell ('p99', 'goodput', 'pow2-2x'), a miss inside
    overlapping intervals suffixed '(tie)'."""
    out = []
    if "p99_within_5pct" not in check:
        return out
    for metric in ("p99", "goodput"):
        if not check[f"{metric}_within_5pct"]:
            tie = check[f"{metric}_not_significantly_worse"]
            out.append(f"{metric}{' (tie)' if tie else ''}")
    ratio = check.get("pow2_over_ours_p99")
    if workload in POW2_FLOOR_WORKLOADS and ratio is not None and ratio < POW2_FACTOR_FLOOR:
        out.append("pow2-2x")
    return out


def _verdict(workload: str, check: dict[str, Any]) -> str:
    if "p99_within_5pct" not in check:
        return "iterserve not run in this cell."
    missed = misses(workload, check)
    head = "iterserve meets the floors" if not missed else (
        f"iterserve MISSES a floor ({', '.join(missed)})")
    ties = ", ".join(check["p99_ties"])
    extra = ""
    if "pow2_over_ours_p99" in check:
        extra = f"; pow2 p99 / iterserve p99 = {check['pow2_over_ours_p99']:.2f}x"
    good = ("goodput tied (every router's interval overlaps the best)"
            if len(check["goodput_ties"]) == check["routers"]
            else f"best goodput {check['best_goodput']}")
    return (f"{head}: best p99 {check['best_p99']}, {good}; "
            f"p99 tie group (overlapping CIs): {ties}{extra}.")


def _cell_table(rows: list[dict[str, Any]], best_p99: str) -> list[str]:
    scaled = any("goodput_unscaled_rps" in r for r in rows)
    head = ("| router | p50 TTFT s [95% CI] | p99 TTFT s [95% CI] | p99 ITL s | tok/s | "
            "goodput req/s [95% CI] |" + (" goodput, unscaled SLO |" if scaled else "") +
            " preempt | prefix hit | CPU s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(rows, key=lambda r: r["ttft_p99_s"][0]):
        mark = " **(best p99)**" if r["router"] == best_p99 else ""
        unscaled = (f" {_fmt(r['goodput_unscaled_rps'], 2)} |" if scaled else "")
        cpu = r.get("cpu_s")
        lines.append(f"| {r['router']}{mark} | {_fmt(r['ttft_p50_s'])} | "
                     f"{_fmt(r['ttft_p99_s'])} | {r['itl_p99_s']:.3f} | "
                     f"{r['throughput_tok_s']:.0f} | {_fmt(r['goodput_rps'], 2)} |{unscaled} "
                     f"{r['preemptions']} | {r['prefix_hit_rate']:.2f} | "
                     f"{'-' if cpu is None else f'{cpu:.0f}'} |")
    return lines


def _router_section(title: str, groups: dict[tuple, list[dict[str, Any]]]
                    ) -> tuple[list[str], list[str]]:
    lines = [f"## {title}", ""]
    missed = []
    for (workload, n, load, scale), rows in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3])):
        check = floor_check(rows)
        first = rows[0]
        slo = (f", SLO TTFT <= {first['slo_ttft_s']:g} s, ITL <= {first['slo_itl_s']:g} s"
               if scale != "null" and "slo_ttft_s" in first else "")
        load_txt = "" if load is None else f", load {load}"
        lines += [f"### {workload}, {n} replicas{load_txt}{_scale_txt(scale)} "
                  f"({first['rate']:.1f} req/s, {first['duration_s']:.0f} virtual s, "
                  f"{first['requests']} requests{slo})", ""]
        if first["requests"] < FEW_REQUESTS:
            top = max(2, math.ceil(first["requests"] / 100))
            lines += [f"Only {first['requests']} requests: the p99 is one of the {top} "
                      "largest TTFTs, so the intervals are wide and a ranking is weak "
                      "evidence.", ""]
        lines += _cell_table(rows, check["best_p99"])
        lines += ["", _verdict(workload, check), ""]
        found = misses(workload, check)
        if found:
            missed.append(f"{workload}/{n}/{load}{_scale_txt(scale)}: {', '.join(found)}")
    return lines, missed


def _matrix(groups: dict[tuple, list[dict[str, Any]]]) -> list[str]:
    """One line per workload and size, one column per load: the floors at a glance."""
    loads = sorted({k[2] for k in groups if k[2] is not None})
    keys = sorted({(k[0], k[1]) for k in groups})
    if not loads or not keys:
        return []
    lines = ["| workload | replicas | " + " | ".join(f"load {x}" for x in loads) + " |",
             "|---|---|" + "---|" * len(loads)]
    for workload, n in keys:
        cols = []
        for load in loads:
            rows = groups.get((workload, n, load, "null"))
            if not rows:
                cols.append("-")
                continue
            check = floor_check(rows)
            found = misses(workload, check)
            ratio = check.get("pow2_over_ours_p99")
            ratio_txt = f", pow2 {ratio:.1f}x" if ratio is not None else ""
            cols.append(("MISS " + ", ".join(found) if found else "ok") + ratio_txt)
        lines.append(f"| {workload} | {n} | " + " | ".join(cols) + " |")
    return lines + [""]


def _sensitivity_ranking(cells: list[dict[str, Any]]) -> list[str]:
    """Per workload: iterserve's p99 and goodput rank at each cost scale (the 8-replica,
    80 % router cell as the unscaled one)."""
    sens = [c for c in cells if c["kind"] == "sensitivity"]
    if not sens:
        return []
    base = [c for c in cells if c["kind"] == "router" and c.get("cost_scale") is None
            and any(s["workload"] == c["workload"] and s["replicas"] == c["replicas"]
                    and s["load"] == c["load"] for s in sens)]
    groups = group_cells(sens, "sensitivity")
    groups.update(group_cells(base, "router"))
    lines = ["| workload | cost scale | SLO (TTFT, ITL) | iterserve p99 rank | "
             "iterserve goodput rank | goodput rank, unscaled SLO | floors |",
             "|---|---|---|---|---|---|---|"]
    for (workload, _, _, scale), rows in sorted(groups.items()):
        counted = [r for r in rows if _counted(r["router"])]
        if not any(r["router"] == OURS for r in counted):
            continue

        def rank(key: str, lower: bool, rows: list[dict[str, Any]] = counted) -> str:
            """1 + the routers strictly better by point estimate; '=' marks a shared rank."""
            if key not in rows[0]:
                return "-"
            ours = next(r[key][0] for r in rows if r["router"] == OURS)
            better = sum(1 for r in rows if (r[key][0] < ours if lower else r[key][0] > ours))
            shared = any(r[key][0] == ours for r in rows if r["router"] != OURS)
            return f"{better + 1}{'=' if shared else ''} of {len(rows)}"

        first = rows[0]
        slo = f"{first.get('slo_ttft_s', 2.0):g} s, {first.get('slo_itl_s', 0.1):g} s"
        found = misses(workload, floor_check(rows))
        unscaled = rank("goodput_unscaled_rps", False) if scale != "null" else "(same)"
        lines.append(f"| {workload} | {'1' if scale == 'null' else scale} | {slo} | "
                     f"{rank('ttft_p99_s', True)} | {rank('goodput_rps', False)} | "
                     f"{unscaled} | {'MISS ' + ', '.join(found) if found else 'ok'} |")
    return lines + [""]


def _autoscaler_groups(cells: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        if c["kind"] == "autoscaler":
            groups[(c.get("load") or 0.0, c["duration_s"], c["seed"])].append(c)
    return groups


def autoscaler_verdict(rows: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """(iterserve meets the autoscaling floor, or None if not run; the sentence)."""
    meeting = [(r["gpu_hours"], r.get("label") or r["autoscaler"]) for r in rows
               if r["ttft_slo_attainment"] >= SLO_ATTAINMENT_FLOOR]
    ours = next((r for r in rows if r["autoscaler"] == OURS), None)
    if ours is None:
        return None, "iterserve not run."
    others = [m for m in meeting if m[1] != OURS]
    cheapest = min(others) if others else (float("inf"), "none")
    meets = ours["ttft_slo_attainment"] >= SLO_ATTAINMENT_FLOOR
    cheaper = ours["gpu_hours"] <= cheapest[0]
    if not meets:
        return False, (f"iterserve MISSES the 99 % TTFT SLO (cheapest autoscaler meeting it: "
                       f"{cheapest[1]}).")
    return cheaper, (f"iterserve meets the 99 % TTFT SLO with {ours['gpu_hours']:.3f} GPU-h, "
                     f"{'no more than' if cheaper else 'MORE than'} the cheapest baseline "
                     f"meeting it ({cheapest[1]}, {cheapest[0]:.3f} GPU-h).")


def _autoscaler_section(cells: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    groups = _autoscaler_groups(cells)
    if not groups:
        return [], []
    lines = ["## Autoscalers: diurnal with a 3x spike within 10 s", "",
             "Mean rate = load x 8 replicas' capacity; every autoscaler starts at 8 replicas "
             "and is bounded by [2, 2x the spike's need]; replica start-up 30 s; iterserve "
             "router. GPU-hours count a replica from its start (start-up included).", "",
             "| load | virtual s | seed | iterserve GPU-h | iterserve SLO | cheapest baseline "
             "meeting the SLO | verdict |", "|---|---|---|---|---|---|---|"]
    detail: list[str] = []
    missed = []
    for (load, duration, seed), rows in sorted(groups.items()):
        ok, sentence = autoscaler_verdict(rows)
        ours = next((r for r in rows if r["autoscaler"] == OURS), None)
        meeting = sorted((r["gpu_hours"], r.get("label") or r["autoscaler"]) for r in rows
                         if r["ttft_slo_attainment"] >= SLO_ATTAINMENT_FLOOR
                         and r["autoscaler"] != OURS)
        best = f"{meeting[0][1]} {meeting[0][0]:.3f}" if meeting else "none"
        if ours is not None:
            lines.append(f"| {load} | {duration:.0f} | {seed} | {ours['gpu_hours']:.3f} | "
                         f"{100 * ours['ttft_slo_attainment']:.2f} % | {best} | "
                         f"{'ok' if ok else 'MISS'} |")
        if ok is False:
            missed.append(f"autoscaler load {load}, {duration:.0f} s, seed {seed}")
        detail += [f"### load {load}, {duration:.0f} virtual s, seed {seed} "
                   f"({rows[0]['rate']:.1f} req/s mean)", "",
                   "| autoscaler | GPU-hours | TTFT <= 2 s | p99 TTFT s [95% CI] | "
                   "goodput req/s | peak replicas |", "|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: r["gpu_hours"]):
            peak = max(run + start for _, run, start in r["replicas_over_time"])
            detail.append(f"| {r.get('label') or r['autoscaler']} | {r['gpu_hours']:.3f} | "
                          f"{100 * r['ttft_slo_attainment']:.2f} % | {_fmt(r['ttft_p99_s'])} "
                          f"| {r['goodput_rps'][0]:.2f} | {peak} |")
        detail += ["", sentence, ""]
    return lines + [""] + detail, missed


def write_report(store: dict[str, Any], out: Path, stem: str) -> None:
    """DIR/stem.md and the plots; DIR/stem_notes.md (hand-written run notes: machine,
    what was run and what not, analysis), where it exists, goes in after the summary."""
    cells = list(store["cells"].values())
    notes_path = out / f"{stem}_notes.md"
    notes = notes_path.read_text().strip() if notes_path.exists() else ""
    commands = store.get("commands") or [store.get("command", "")]
    lines = [f"# Routing and autoscaling tournament ({stem})", "",
             "Commands: " + "; ".join(f"`{c}`" for c in commands) + ". Simulated "
             "Llama-3-8B on H100 (`replica/sim_runner.py` cost model), 2 independent ingress "
             "routers, routing stats every 0.5 s, SLO: TTFT <= 2 s and per-request p99 ITL "
             "<= 100 ms (scaled with the cost factor in the sensitivity cells). Intervals: "
             "bootstrap 95 % (1000 resamples). A win is claimed only where intervals do not "
             "overlap; a floor missed by the point estimate inside overlapping intervals is "
             "marked '(tie)'.", ""]
    caps = store.get("capacity", {})
    if caps:
        lines += ["Capacity (req/s per replica, round-robin, 8 replicas): " + ", ".join(
            f"{json.loads(k)[0]}{'' if json.loads(k)[1] is None else ' x' + str(json.loads(k)[1])}"
            f" {v:.2f}" for k, v in sorted(caps.items())), ""]
    routers = group_cells(cells, "router")
    sens = group_cells(cells, "sensitivity")
    router_lines, router_misses = (_router_section("Routers", routers) if routers
                                   else ([], []))
    sens_lines, sens_misses = (_router_section(
        "Sensitivity: every cost coefficient scaled", sens) if sens else ([], []))
    auto_lines, auto_misses = _autoscaler_section(cells)
    traces = group_cells(cells, "trace")
    trace_lines, trace_misses = (_router_section(
        "Trace replays (arrival times divided by the speed)", traces) if traces else ([], []))
    all_misses = router_misses + sens_misses + auto_misses + trace_misses
    lines += ["## Floors at a glance", ""] + _matrix(routers) + _matrix(traces)
    lines += [f"Cells where iterserve misses a floor: {len(all_misses)}"
              + (": " + "; ".join(all_misses) if all_misses else ": none"), ""]
    if sens:
        lines += ["Sensitivity (8 replicas, load 0.8): iterserve's rank among the routers "
                  "at each cost scale. Doubling (halving) every coefficient is the same "
                  "cluster running 2x slower (faster) at the same fraction of its capacity, "
                  "so every latency scales by the factor; the SLO is scaled with it (TTFT "
                  "<= 4 s and ITL <= 200 ms at x2), else goodput at x2 would count which "
                  "requests are luckily under a line every router's p99 ITL is past. The "
                  "goodput under the unscaled SLO is reported beside it.", ""]
        lines += _sensitivity_ranking(cells)
    if notes:
        lines += [notes, ""]
    lines += router_lines + sens_lines + auto_lines + trace_lines
    (out / f"{stem}.md").write_text("\n".join(lines))
    write_plots(cells, out, stem)
