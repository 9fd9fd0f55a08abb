"""Arrival processes: when each request of a workload is sent. The one place they are drawn.

Every function takes the caller's `random.Random` (or a seed) and draws from it in a fixed
order, so a workload that draws its request contents from the same stream gets the same
requests for the same seed. `arrival_times` is lazy: a generator may draw a request's
contents between two arrivals (the step load does).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator


def arrival_times(rng: random.Random, rate_at: Callable[[float], float], duration_s: float
                  ) -> Iterator[float]:
    """A Poisson process whose rate, per second, is rate_at(t) at the previous arrival t
    (0 before the first): exact for a piecewise-constant rate that changes rarely between
    arrivals, as a step load's does. Times in (0, duration_s), increasing."""
    t = 0.0
    while True:
        t += rng.expovariate(rate_at(t))
        if t >= duration_s:
            return
        yield t


def poisson_times(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Poisson arrivals at `rate` per second over (0, duration_s)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be > 0")
    return list(arrival_times(rng, lambda _: rate, duration_s))


def thinned_times(rng: random.Random, peak: float, duration_s: float,
                  shape: Callable[[float], float]) -> list[float]:
    """A non-homogeneous Poisson process of rate peak * shape(t) (shape in [0, 1]): Poisson
    arrivals at the peak rate, each kept with probability shape(t) (drawn after all of them)."""
    return [t for t in poisson_times(rng, peak, duration_s) if rng.random() < shape(t)]


def poisson_gaps(rng: random.Random, rate: float) -> Iterator[float]:
    """The gaps between Poisson arrivals at `rate` per second, for a pacer that sends in real
    time (Locust's): no end."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    while True:
        yield rng.expovariate(rate)
