"""The tournament's plots: p99 TTFT vs load per router (one panel per workload and size),
replicas over time per autoscaler (one panel per load and duration, seed 0)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

OURS = "iterserve"


def write_plots(cells: list[dict[str, Any]], out: Path, stem: str) -> None:
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
            by_router: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
            for c in routed:
                if c["workload"] == workload and c["replicas"] == n:
                    by_router[c["router"]].append((c["load"], *c["ttft_p99_s"]))
            for router, pts in sorted(by_router.items()):
                pts.sort()
                xs = [p[0] for p in pts]
                ax.errorbar(xs, [p[1] for p in pts],
                            yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                            marker="o", ms=3, capsize=2, lw=2.5 if router == OURS else 1,
                            label=router)
            ax.set_yscale("log")
            ax.set_title(f"{workload}, {n} replicas", fontsize=9)
            ax.set_xlabel("load (fraction of capacity)")
            ax.set_ylabel("p99 TTFT (s), 95% CI")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"{stem}_p99_ttft.png", dpi=90)
        plt.close(fig)
    scaled = [c for c in cells if c["kind"] == "autoscaler"]
    seed = min((c["seed"] for c in scaled), default=0)
    groups = sorted({(c.get("load") or 0.0, c["duration_s"]) for c in scaled})
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
        for ax, (load, duration) in zip(axes.flat, groups, strict=True):
            for c in scaled:
                if (c.get("load") or 0.0, c["duration_s"], c["seed"]) != (load, duration, seed):
                    continue
                pts = list(c["replicas_over_time"])
                pts.append((c["end_time_s"], *pts[-1][1:]))  # changes only: hold to the end
                ax.step([p[0] for p in pts], [p[1] + p[2] for p in pts], where="post",
                        lw=2.5 if c["autoscaler"] == OURS else 1,
                        label=c.get("label") or c["autoscaler"])
            ax.set_title(f"diurnal, load {load}, {duration:.0f} s, seed {seed}", fontsize=9)
            ax.set_xlabel("virtual time (s)")
            ax.set_ylabel("replicas (running + starting)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{stem}_replicas.png", dpi=90)
        plt.close(fig)
