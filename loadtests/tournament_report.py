"""Render tournament.json to markdown tables, floor checks and plots."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from iterserve.loadtests.tournament_stats import Interval, best_of, within

OURS = "iterserve"
TOLERANCE = 0.05


def _iv(values: list[float]) -> Interval:
    return Interval(*values)


def _fmt(values: list[float], digits: int = 3) -> str:
    v, lo, hi = values
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _groups(cells: list[dict[str, Any]], kind: str) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        if c["kind"] == kind:
            scale = json.dumps(c.get("cost_scale"), sort_keys=True)
            groups[(c["workload"], c["replicas"], c["load"], scale)].append(c)
    return groups


def floor_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where iterserve stands in one cell: best by point estimate, within 5 %, and
    whether a difference is significant (intervals apart)."""
    p99 = {r["router"]: _iv(r["ttft_p99_s"]) for r in rows}
    good = {r["router"]: _iv(r["goodput_rps"]) for r in rows}
    best_p99, p99_ties = best_of(p99, lower_is_better=True)
    best_good, good_ties = best_of(good, lower_is_better=False)
    out: dict[str, Any] = {"best_p99": best_p99, "p99_ties": sorted(p99_ties),
                           "best_goodput": best_good, "goodput_ties": sorted(good_ties)}
    if OURS in p99:
        out["p99_within_5pct"] = within(p99[OURS].value, p99[best_p99].value, TOLERANCE, True)
        out["p99_not_significantly_worse"] = OURS in p99_ties
        out["goodput_within_5pct"] = within(good[OURS].value, good[best_good].value,
                                            TOLERANCE, False)
        out["goodput_not_significantly_worse"] = OURS in good_ties
    if OURS in p99 and "pow2" in p99 and p99[OURS].value > 0:
        out["pow2_over_ours_p99"] = p99["pow2"].value / p99[OURS].value
    return out


def _router_section(title: str, groups: dict[tuple, list[dict[str, Any]]]) -> list[str]:
    lines = [f"## {title}", ""]
    misses = []
    for (workload, n, load, scale), rows in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3])):
        check = floor_check(rows)
        scale_txt = "" if scale == "null" else f", cost x {scale}"
        rate = rows[0]["rate"]
        lines += [f"### {workload}, {n} replicas, load {load}{scale_txt} "
                  f"({rate:.1f} req/s, {rows[0]['requests']} requests)", "",
                  "| router | p50 TTFT s [95% CI] | p99 TTFT s [95% CI] | p99 ITL s | "
                  "tok/s | goodput req/s [95% CI] | preempt | prefix hit |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: r["ttft_p99_s"][0]):
            mark = " **(best p99)**" if r["router"] == check["best_p99"] else ""
            lines.append(f"| {r['router']}{mark} | {_fmt(r['ttft_p50_s'])} | "
                         f"{_fmt(r['ttft_p99_s'])} | {r['itl_p99_s']:.3f} | "
                         f"{r['throughput_tok_s']:.0f} | {_fmt(r['goodput_rps'], 2)} | "
                         f"{r['preemptions']} | {r['prefix_hit_rate']:.2f} |")
        verdict = _verdict(check)
        lines += ["", verdict, ""]
        if verdict.startswith("iterserve MISSES"):
            misses.append(f"{workload}/{n}/{load}{scale_txt}")
    lines += [f"Cells where iterserve misses a floor: {len(misses)}: "
              f"{', '.join(misses) if misses else 'none'}", ""]
    return lines


def _verdict(check: dict[str, Any]) -> str:
    if "p99_within_5pct" not in check:
        return "iterserve not run in this cell."
    parts = []
    ok = True
    for metric in ("p99", "goodput"):
        within5 = check[f"{metric}_within_5pct"]
        not_worse = check[f"{metric}_not_significantly_worse"]
        ok = ok and within5
        parts.append(f"{metric}: {'within 5 % of best' if within5 else 'NOT within 5 %'}"
                     f"{'' if not_worse else ' (significantly worse)'}")
    ties = ", ".join(check["p99_ties"])
    extra = ""
    if "pow2_over_ours_p99" in check:
        extra = f"; pow2 p99 / iterserve p99 = {check['pow2_over_ours_p99']:.2f}x"
    head = "iterserve meets the floors" if ok else "iterserve MISSES a floor"
    return f"{head} ({'; '.join(parts)}); p99 tie group (overlapping CIs): {ties}{extra}."


def _autoscaler_section(cells: list[dict[str, Any]]) -> list[str]:
    rows = [c for c in cells if c["kind"] == "autoscaler"]
    if not rows:
        return []
    lines = ["## Autoscalers: diurnal with a 3x spike within 10 s", "",
             f"{rows[0]['rate']:.1f} req/s mean, {rows[0]['duration_s']:.0f} virtual s, "
             f"bounds [{rows[0]['min_replicas']}, {rows[0]['max_replicas']}], "
             "replica start-up 30 s, iterserve router.", "",
             "| autoscaler | GPU-hours | TTFT <= 2 s | p99 TTFT s [95% CI] | goodput req/s |",
             "|---|---|---|---|---|"]
    meeting = []
    for r in sorted(rows, key=lambda r: r["gpu_hours"]):
        name = r.get("label") or r["autoscaler"]
        lines.append(f"| {name} | {r['gpu_hours']:.3f} | {100 * r['ttft_slo_attainment']:.2f} % "
                     f"| {_fmt(r['ttft_p99_s'])} | {r['goodput_rps'][0]:.2f} |")
        if r["ttft_slo_attainment"] >= 0.99:
            meeting.append((r["gpu_hours"], name))
    ours = next((r for r in rows if r["autoscaler"] == OURS), None)
    if ours is not None:
        others = [m for m in meeting if m[1] != OURS]
        cheapest = min(others)[1] if others else "none"
        meets = ours["ttft_slo_attainment"] >= 0.99
        cheaper = not others or ours["gpu_hours"] <= min(others)[0]
        if meets:
            verdict = (f"iterserve meets the 99 % TTFT SLO and uses "
                       f"{'no more' if cheaper else 'MORE'} GPU-hours than the cheapest other "
                       f"autoscaler meeting it ({cheapest}).")
        else:
            verdict = (f"iterserve MISSES the 99 % TTFT SLO (cheapest autoscaler meeting it: "
                       f"{cheapest}).")
        lines += ["", verdict, ""]
    return lines


def write_report(store: dict[str, Any], out: Path, stem: str) -> None:
    cells = list(store["cells"].values())
    lines = [f"# Routing and autoscaling tournament ({stem})", "",
             f"Command: `{store.get('command', '')}`. Simulated Llama-3-8B on H100 "
             "(`replica/sim_runner.py` cost model), 2 independent ingress routers, routing "
             "stats every 0.5 s, SLO: TTFT <= 2 s and per-request p99 ITL <= 100 ms. "
             "Intervals: bootstrap 95 % (1000 resamples). A win is claimed only where "
             "intervals do not overlap.", ""]
    caps = store.get("capacity", {})
    if caps:
        lines += ["Capacity (req/s per replica, round-robin, 8 replicas): " + ", ".join(
            f"{json.loads(k)[0]}{'' if json.loads(k)[1] is None else ' x' + str(json.loads(k)[1])}"
            f" {v:.2f}" for k, v in sorted(caps.items())), ""]
    lines += _router_section("Routers", _groups(cells, "router"))
    sens = _groups(cells, "sensitivity")
    if sens:
        lines += _router_section("Sensitivity: every cost coefficient scaled", sens)
    lines += _autoscaler_section(cells)
    (out / f"{stem}.md").write_text("\n".join(lines))
    _plots(cells, out, stem)


def _plots(cells: list[dict[str, Any]], out: Path, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routed = [c for c in cells if c["kind"] == "router" and c["load"] is not None]
    panels = sorted({(c["workload"], c["replicas"]) for c in routed})
    if panels:
        cols = 4
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, (workload, n) in zip(axes.flat, panels, strict=False):
            by_router: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for c in routed:
                if c["workload"] == workload and c["replicas"] == n:
                    by_router[c["router"]].append((c["load"], c["ttft_p99_s"][0]))
            for router, pts in sorted(by_router.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        lw=2.5 if router == OURS else 1, label=router)
            ax.set_yscale("log")
            ax.set_title(f"{workload}, {n} replicas", fontsize=9)
            ax.set_xlabel("load (fraction of capacity)")
            ax.set_ylabel("p99 TTFT (s)")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"{stem}_p99_ttft.png", dpi=90)
        plt.close(fig)
    scaled = [c for c in cells if c["kind"] == "autoscaler"]
    if scaled:
        fig, ax = plt.subplots(figsize=(8, 4))
        for c in scaled:
            pts = list(c["replicas_over_time"])
            pts.append((c["end_time_s"], *pts[-1][1:]))  # changes only: hold to the end
            ax.step([p[0] for p in pts], [p[1] + p[2] for p in pts], where="post",
                    lw=2.5 if c["autoscaler"] == OURS else 1,
                    label=c.get("label") or c["autoscaler"])
        ax.set_xlabel("virtual time (s)")
        ax.set_ylabel("replicas (running + starting)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{stem}_replicas.png", dpi=90)
        plt.close(fig)
