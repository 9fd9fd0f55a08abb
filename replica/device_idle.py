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
Kept as count and summed seconds per batch size, so reports from several replicas add up,
and as a histogram of single waits (log-spaced buckets, BUCKETS_PER_DECADE a decade from
1 us): a mean hides the long waits a loaded box gives a replica now and then (the OS runs
another process), and a TTFT tail is made of those.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

BUCKETS_PER_DECADE = 20  # a bucket spans 12 % of its value
SMALLEST_S = 1e-6  # waits below this fall in bucket -1 (read as 0)


def wait_bucket(idle_s: float) -> int:
    """The histogram bucket of one wait: b covers [SMALLEST_S * 10**(b / 20), ... (b + 1))."""
    if idle_s < SMALLEST_S:
        return -1
    return math.floor(math.log10(idle_s / SMALLEST_S) * BUCKETS_PER_DECADE)


def bucket_floor_s(bucket: int) -> float:
    """The smallest wait in a bucket (0 for bucket -1)."""
    return 0.0 if bucket < 0 else SMALLEST_S * 10 ** (bucket / BUCKETS_PER_DECADE)


@dataclass
class DeviceIdleMeter:
    """Per batch size n (requests in the step): steps counted and seconds of device idle."""

    steps: dict[int, int] = field(default_factory=dict)
    idle_s: dict[int, float] = field(default_factory=dict)
    histogram: dict[int, int] = field(default_factory=dict)  # wait_bucket -> waits counted

    def record(self, num_seqs: int, idle_s: float) -> None:
        self.steps[num_seqs] = self.steps.get(num_seqs, 0) + 1
        self.idle_s[num_seqs] = self.idle_s.get(num_seqs, 0.0) + idle_s
        bucket = wait_bucket(idle_s)
        self.histogram[bucket] = self.histogram.get(bucket, 0) + 1

    def report(self) -> dict[str, dict[str, float]]:
        """Plain data (JSON keys are strings): {"steps": {n: count}, "idle_s": {n: sum},
        "histogram": {bucket: count}}."""
        return {"steps": {str(n): float(c) for n, c in sorted(self.steps.items())},
                "idle_s": {str(n): s for n, s in sorted(self.idle_s.items())},
                "histogram": {str(b): float(c) for b, c in sorted(self.histogram.items())}}

    def quantile_s(self, q: float) -> float:
        """The q-quantile of the single waits, to the bucket: the floor of the bucket that
        holds it (so within 12 % below the true value). ValueError when nothing was counted."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}")
        total = sum(self.histogram.values())
        if total == 0:
            raise ValueError("no wait counted")
        rank, seen = q * total, 0
        for bucket, count in sorted(self.histogram.items()):
            seen += count
            if seen >= rank:
                return bucket_floor_s(bucket)
        return bucket_floor_s(max(self.histogram))


def merge_reports(reports: Iterable[Mapping[str, Mapping[str, float]]]) -> DeviceIdleMeter:
    """Several replicas' `report()`s added together."""
    merged = DeviceIdleMeter()
    for report in reports:
        for n, count in report["steps"].items():
            merged.steps[int(n)] = merged.steps.get(int(n), 0) + int(count)
            merged.idle_s[int(n)] = merged.idle_s.get(int(n), 0.0) + report["idle_s"][n]
        for b, count in report.get("histogram", {}).items():  # absent in reports before it
            merged.histogram[int(b)] = merged.histogram.get(int(b), 0) + int(count)
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
    """What `sim_validation --engine-cpu measured` reads: the fit and the plain mean; and the
    single waits' p50 / p90 / p99 / p999 / max (bucket floors) where the meter kept them."""
    per_step, per_seq = fit_idle(meter)
    steps = sum(meter.steps.values())
    mean_seqs = sum(n * c for n, c in meter.steps.items()) / steps
    report = {"per_step_s": per_step, "per_seq_s": per_seq, "steps": float(steps),
              "mean_idle_s": sum(meter.idle_s.values()) / steps, "mean_batch": mean_seqs}
    if meter.histogram:
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
            report[f"{name}_idle_s"] = meter.quantile_s(q)
        report["max_idle_s"] = bucket_floor_s(max(meter.histogram))
    return report


@dataclass(frozen=True)
class WaitDistribution:
    """Single engine-CPU waits to draw from, one per simulated step that continues a batch
    (the cluster simulator's stand-in for the meter's measurement, tail included).

    values[i] is drawn with probability weights[i] / sum(weights); `per_seq_s` moves a draw
    by the meter's slope for a batch larger or smaller than the measured mean
    (`draw(u, n) = max(0, values[i] + per_seq_s * (n - mean_batch))`), so the mean wait at
    the mean batch is the measured one."""

    values: tuple[float, ...]
    weights: tuple[float, ...]
    per_seq_s: float = 0.0
    mean_batch: float = 0.0
    _cumulative: tuple[float, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.weights):
            raise ValueError("values and weights must be non-empty and aligned")
        if min(self.weights) < 0 or sum(self.weights) <= 0 or min(self.values) < 0:
            raise ValueError("weights and values must be >= 0, with some weight")
        cumulative, total = [], 0.0
        for weight in self.weights:
            total += weight
            cumulative.append(total)
        object.__setattr__(self, "_cumulative", tuple(c / total for c in cumulative))

    @classmethod
    def from_histogram(cls, histogram: Mapping[str, float], mean_idle_s: float,
                       per_seq_s: float = 0.0, mean_batch: float = 0.0) -> WaitDistribution:
        """From a meter's report()["histogram"]: each bucket's geometric middle, every value
        scaled so that the distribution's mean is mean_idle_s (the meter's exact mean)."""
        buckets = sorted((int(b), float(c)) for b, c in histogram.items())
        middles = [0.0 if b < 0 else bucket_floor_s(b) * 10 ** (0.5 / BUCKETS_PER_DECADE)
                   for b, _ in buckets]
        weights = [c for _, c in buckets]
        mean = sum(m * w for m, w in zip(middles, weights, strict=True)) / sum(weights)
        scale = mean_idle_s / mean if mean > 0 else 0.0
        return cls(tuple(m * scale for m in middles), tuple(weights), per_seq_s, mean_batch)

    @classmethod
    def from_quantiles(cls, fit: Mapping[str, float]) -> WaitDistribution:
        """From a fit_report's p50 / p90 / p99 / p999 / max and mean (a Ray run recorded
        before the histogram itself was kept): one value per quantile band, the tail's
        bands (above p90) at their measured middles, the two body bands scaled together so
        that the mean is the measured mean (the body at 0 where the tail alone exceeds it)."""
        p50, p90, p99 = fit["p50_idle_s"], fit["p90_idle_s"], fit["p99_idle_s"]
        p999, top = fit["p999_idle_s"], fit["max_idle_s"]
        weights = (0.5, 0.4, 0.09, 0.009, 0.001)
        tail = ((p90 + p99) / 2, (p99 + p999) / 2, (p999 + top) / 2)
        body = (p50, (p50 + p90) / 2)
        body_mass = sum(w * v for w, v in zip(weights[:2], body, strict=True))
        tail_mass = sum(w * v for w, v in zip(weights[2:], tail, strict=True))
        scale = max(0.0, fit["mean_idle_s"] - tail_mass) / body_mass if body_mass > 0 else 0.0
        return cls((body[0] * scale, body[1] * scale, *tail), weights,
                   fit.get("per_seq_s", 0.0), fit.get("mean_batch", 0.0))

    def draw(self, u: float, num_seqs: int) -> float:
        """The wait for uniform u in [0, 1) and a batch of num_seqs requests."""
        i = bisect.bisect_right(self._cumulative, u)
        wait = self.values[min(i, len(self.values) - 1)]
        return max(0.0, wait + self.per_seq_s * (num_seqs - self.mean_batch))
