"""How long a tournament run takes: a CPU-time model of a cell, fitted to measured cells.

A cell's CPU time is modelled as duration x (a x replicas + b x rate + c x rate x replicas):
engine steps of every replica (a), the per-request work of the engine and the workload (b),
and routing, where each request is scored against every replica (c). The coefficients are
fitted (least squares, no negatives) to the cells already in the store that recorded their
`cpu_s`; with fewer than MIN_FIT_CELLS of them, DEFAULT_COEFFS (measured on the shared
2-core box, wave 4) are used. An autoscaler cell is costed at its starting replica count
(its CPU time is mostly per request: ray-default's 48 replicas cost it little more).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

MIN_FIT_CELLS = 6
BUDGET_S = 3600.0  # the issue: the whole matrix within 60 minutes
# CPU seconds per (replica x virtual s), per (request/s x virtual s), per (request/s x
# replica x virtual s): fitted to the wave-4 runs (8 replicas, all workloads, 0.5-0.95).
DEFAULT_COEFFS = (6.0e-3, 1.0e-3, 4.0e-5)


def _features(cell: dict[str, Any]) -> tuple[float, float, float]:
    replicas, d, rate = float(cell["replicas"]), float(cell["duration_s"]), float(cell["rate"])
    return d * replicas, d * rate, d * rate * replicas


def fit(measured: Sequence[dict[str, Any]]) -> tuple[tuple[float, float, float], int]:
    """(coefficients, how many cells they were fitted to; 0: the defaults)."""
    rows = [c for c in measured if c.get("cpu_s") is not None and c.get("kind") != "autoscaler"]
    if len(rows) < MIN_FIT_CELLS:
        return DEFAULT_COEFFS, 0
    x = np.array([_features(c) for c in rows])
    y = np.array([c["cpu_s"] for c in rows])
    active = [0, 1, 2]
    while True:  # drop a coefficient that fits negative, refit the rest
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = [0.0, 0.0, 0.0]
    for i, c in zip(active, coef, strict=True):
        full[i] = max(float(c), 0.0)
    return (full[0], full[1], full[2]), len(rows)


def cell_cpu_s(cell: dict[str, Any], coeffs: tuple[float, float, float]) -> float:
    return sum(c * f for c, f in zip(coeffs, _features(cell), strict=True))


def print_estimate(todo: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]],
                   jobs: int) -> float:
    """Print the cells to run, grouped, with their estimated CPU time; return the estimated
    wall time with `jobs` workers (the CPU time spread over them, and no less than the
    longest cell)."""
    coeffs, fitted = fit(measured)
    source = f"fitted to {fitted} measured cells" if fitted else "defaults (no measured cells)"
    print(f"cost model: CPU s = duration x ({coeffs[0]:.2e} x replicas + {coeffs[1]:.2e} x "
          f"rate + {coeffs[2]:.2e} x rate x replicas), {source}")
    groups: dict[tuple, list[float]] = defaultdict(list)
    for cell in todo:
        groups[(cell["kind"], cell["replicas"] if cell["kind"] != "autoscaler" else "-",
                cell["duration_s"] if cell["kind"] == "autoscaler" else "-")].append(
            cell_cpu_s(cell, coeffs))
    total = 0.0
    for (kind, n, d), costs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        total += sum(costs)
        size = f"{n} replicas" if n != "-" else f"{d:.0f} virtual s"
        print(f"  {kind:12s} {size:>16s}: {len(costs):4d} cells, {sum(costs):8.0f} CPU s "
              f"(longest {max(costs):.0f} s)")
    longest = max((cell_cpu_s(c, coeffs) for c in todo), default=0.0)
    wall = max(total / max(jobs, 1), longest)
    verdict = "fits" if wall <= BUDGET_S else "does NOT fit"
    print(f"total {len(todo)} cells, {total:.0f} CPU s: ~{wall / 60:.0f} min with --jobs "
          f"{jobs} ({verdict} the {BUDGET_S / 60:.0f}-minute budget)")
    return wall
