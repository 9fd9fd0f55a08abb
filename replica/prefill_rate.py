"""`PrefillRateMeter`: the prefill_token_rate a replica reports to routers.

Prompt tokens computed per second of step time, over the steps that prefilled and ended in
the last `RATE_WINDOW_S` seconds. Per second of *step* time, not of wall time: a router
drains a replica's queued prefill at this rate, and an idle stretch says nothing about how
fast the replica computes prompts. The engine (`engine_stats.py`) and the cluster
simulator's replica (`autoscale/sim/simulated_replica.py`) both measure it with this class,
so a simulated replica reports what a real one would.
"""

from __future__ import annotations

from collections import deque

RATE_WINDOW_S = 2.0  # window of the step_token_rate and prefill_token_rate signals


class PrefillRateMeter:
    """Invariant: `_recent` holds (end time, prompt tokens, step seconds) of prefilling
    steps in the order they ended; `rate(now)` first drops those that ended more than
    RATE_WINDOW_S before now."""

    __slots__ = ("_recent",)

    def __init__(self) -> None:
        self._recent: deque[tuple[float, int, float]] = deque()

    def record(self, end: float, prompt_tokens: int, seconds: float) -> None:
        """One step that ended at `end` after `seconds` and computed `prompt_tokens`;
        steps without prompt tokens or without measurable time are not rate samples."""
        if prompt_tokens and seconds > 0:
            self._recent.append((end, prompt_tokens, seconds))

    def rate(self, now: float) -> float:
        """Prompt tokens per step second over the window ending at now (0.0: no sample)."""
        recent = self._recent
        while recent and now - recent[0][0] > RATE_WINDOW_S:
            recent.popleft()
        # Summed afresh (a window is ~100 steps), not kept as a running total: a running
        # float total drifts with every subtraction, and routers compare these rates.
        seconds = sum(s for _, _, s in recent)
        return sum(t for _, t, _ in recent) / seconds if seconds > 0 else 0.0

    def mean_seconds(self, now: float) -> float:
        """The mean seconds of a sample in the window ending at now (0.0: no sample)."""
        self.rate(now)  # drops the samples that left the window
        recent = self._recent
        return sum(s for _, _, s in recent) / len(recent) if recent else 0.0

    def samples(self) -> list[tuple[float, int, float]]:
        """The (end time, prompt tokens, step seconds) samples in the window, oldest first."""
        return list(self._recent)
