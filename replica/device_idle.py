"""How long the simulated GPU waits for the engine between steps that continue a batch.

The simulated runner's step lasts its modelled time; with async scheduling off the engine's
own CPU work (finishing the step, streaming its tokens, the loop's commands, scheduling the
next step) happens while the "GPU" waits, so on a busy engine every step really lasts the
modelled time plus that wait. The cluster simulator's replicas take no CPU time, so when it
replays a Ray run of the simulated engine this is the term it must add
(`sim_validation --engine-cpu`). Measured where it happens (inside a Ray replica, sharing the
box with the rest of the cluster), not in a quiet process.

Only gaps before a step that carries on a request from the step before count: then the
engine had unfinished work and stepped again at once, so the gap is CPU time, not idleness.
Kept as count and summed seconds per batch size, so reports from several replicas add up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class DeviceIdleMeter:
    """Per batch size n (requests in the step): steps counted and seconds of device idle."""

    steps: dict[int, int] = field(default_factory=dict)
    idle_s: dict[int, float] = field(default_factory=dict)

    def record(self, num_seqs: int, idle_s: float) -> None:
        self.steps[num_seqs] = self.steps.get(num_seqs, 0) + 1
        self.idle_s[num_seqs] = self.idle_s.get(num_seqs, 0.0) + idle_s

    def report(self) -> dict[str, dict[str, float]]:
        """Plain data (JSON keys are strings): {"steps": {n: count}, "idle_s": {n: sum}}."""
        return {"steps": {str(n): float(c) for n, c in sorted(self.steps.items())},
                "idle_s": {str(n): s for n, s in sorted(self.idle_s.items())}}


def merge_reports(reports: Iterable[Mapping[str, Mapping[str, float]]]) -> DeviceIdleMeter:
    """Several replicas' `report()`s added together."""
    merged = DeviceIdleMeter()
    for report in reports:
        for n, count in report["steps"].items():
            merged.steps[int(n)] = merged.steps.get(int(n), 0) + int(count)
            merged.idle_s[int(n)] = merged.idle_s.get(int(n), 0.0) + report["idle_s"][n]
    return merged


def fit_idle(meter: DeviceIdleMeter) -> tuple[float, float]:
    """(per_step_s, per_seq_s): the line idle = per_step + per_seq * n through every counted
    step, each weighted alike (the per-n means, weighted by their counts); the per-step mean
    and a zero slope when only one batch size was seen; ValueError when nothing was."""
    total = sum(meter.steps.values())
    if total == 0:
        raise ValueError("no step continued a batch: nothing measured")
    if len(meter.steps) == 1:
        return sum(meter.idle_s.values()) / total, 0.0
    # Weighted least squares over the per-n means (the stdlib's linear_regression takes no
    # weights): the same line as one fitted through every step.
    rows = [(count, n, meter.idle_s[n] / count) for n, count in meter.steps.items()]
    mean_x = sum(w * x for w, x, _ in rows) / total
    mean_y = sum(w * y for w, _, y in rows) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x, _ in rows)
    sxy = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in rows)
    slope = sxy / sxx
    return mean_y - slope * mean_x, slope


def fit_report(meter: DeviceIdleMeter) -> dict[str, float]:
    """What `sim_validation --engine-cpu measured` reads: the fit, and the plain mean."""
    per_step, per_seq = fit_idle(meter)
    steps = sum(meter.steps.values())
    mean_seqs = sum(n * c for n, c in meter.steps.items()) / steps
    return {"per_step_s": per_step, "per_seq_s": per_seq, "steps": float(steps),
            "mean_idle_s": sum(meter.idle_s.values()) / steps, "mean_batch": mean_seqs}
