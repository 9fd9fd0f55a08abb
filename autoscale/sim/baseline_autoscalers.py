"""Published autoscaling policies over the `ScalingContext` contract, beside iterserve's.

Each rule is a pure function of the context and the policy's own timer state; the classes
are thin `AutoscalingPolicy` wrappers that hold that state between ticks (the simulator
and Serve call them every control-loop tick with metrics averaged over a look-back window).

- `FixedReplicas`: N replicas, never changes (the static-provisioning baseline).
- `RayDefaultAutoscaler`: Ray Serve's `replica_queue_length_autoscaling_policy`.
- `ThresholdAutoscaler`: KEDA / AIBrix HPA-style thresholds on vLLM's waiting requests and
  KV-cache usage.
- `IterserveAutoscaler`: `autoscale/autoscaling_policy.py`'s `decide`, called as the Ray adapter calls it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from iterserve.autoscale.autoscaling_policy import ScalingContext, decide
from iterserve.autoscale.config import AutoscaleConfig


def _live(ctx: ScalingContext) -> list:
    return [s for s in ctx.signals.values() if not s.draining]


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


class FixedReplicas:
    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"need at least one replica, got {replicas}")
        self.replicas = replicas
        self.name = f"fixed-{replicas}"

    def desired_replicas(self, ctx: ScalingContext) -> int:
        return self.replicas


# ----------------------------------------------------------------------------- Ray default
@dataclass(frozen=True)
class RayAutoscalingConfig:
    """Ray Serve AutoscalingConfig defaults (ray/serve/config.py, 2.60):
    target_ongoing_requests 2, upscale_delay_s 30, downscale_delay_s 600, smoothing 1."""

    min_replicas: int = 1
    max_replicas: int = 8
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0


def ray_desired_replicas(total_ongoing: float, current: int, config: RayAutoscalingConfig
                         ) -> int:
    """Ray's `_calculate_desired_num_replicas`: error = ongoing / (target x current);
    desired = ceil(current x (1 + (error - 1) x smoothing factor)), clamped. From zero
    replicas any demand asks for one."""
    if current == 0:
        return _clamp(1 if total_ongoing > 0 else 0, config.min_replicas, config.max_replicas)
    error = total_ongoing / (config.target_ongoing_requests * current)
    factor = config.upscaling_factor if error > 1 else config.downscaling_factor
    desired = math.ceil(current * (1 + (error - 1) * factor))
    return _clamp(desired, config.min_replicas, config.max_replicas)


class RayDefaultAutoscaler:
    """Ray's default policy with its decision delays: a scale-up (down) happens once every
    tick for upscale_delay_s (downscale_delay_s) wanted one (Ray counts consecutive ticks of
    CONTROL_LOOP_INTERVAL_S; a time stamp is the same for regular ticks); a tick that wants
    the other direction or no change resets the count. Ongoing requests = running + waiting
    at replicas + queued at handles (Serve's total_num_requests)."""

    def __init__(self, config: RayAutoscalingConfig) -> None:
        self.config = config
        self.name = "ray-default"
        self._up_since: float | None = None
        self._down_since: float | None = None

    def desired_replicas(self, ctx: ScalingContext) -> int:
        ongoing = sum(s.num_running + s.num_waiting for s in _live(ctx)) + ctx.queued_at_handles
        current = ctx.target_replicas
        want = ray_desired_replicas(ongoing, ctx.current_replicas, self.config)
        if ctx.current_replicas == 0 and want > 0:  # Serve's cold start skips the delay
            self._up_since = self._down_since = None
            return max(want, current)
        if want > current:
            self._down_since = None
            self._up_since = ctx.now if self._up_since is None else self._up_since
            if ctx.now - self._up_since >= self.config.upscale_delay_s:
                self._up_since = None
                return want
        elif want < current:
            self._up_since = None
            self._down_since = ctx.now if self._down_since is None else self._down_since
            if ctx.now - self._down_since >= self.config.downscale_delay_s:
                self._down_since = None
                return want
        else:
            self._up_since = self._down_since = None
        return current


# ----------------------------------------------------------------------------- KEDA / HPA
@dataclass(frozen=True)
class ThresholdConfig:
    """KEDA / AIBrix HPA on vLLM metrics. HPA defaults (Kubernetes docs): tolerance 0.1,
    scale-down stabilisation window 300 s, scale-up at most max(2x, +4 pods) per 15 s
    period. Targets (ours; the projects give examples, not defaults): 3 waiting requests
    per replica (vllm:num_requests_waiting) and 0.6 KV usage (gpu_cache_usage_perc)."""

    min_replicas: int = 1
    max_replicas: int = 8
    target_waiting: float = 3.0
    target_kv_usage: float = 0.6
    tolerance: float = 0.1
    downscale_window_s: float = 300.0
    upscale_period_s: float = 15.0


def hpa_recommendation(ctx: ScalingContext, config: ThresholdConfig) -> int:
    """HPA's rule over several metrics: desired = ceil(current x metric / target) for each,
    the largest wins; a ratio within tolerance of 1 keeps current."""
    live = _live(ctx)
    current = max(ctx.current_replicas, 1)
    if not live:  # KEDA's activation: from zero, any demand asks for one replica
        if ctx.target_replicas < 1 and ctx.queued_at_handles > 0:
            return _clamp(1, 1, config.max_replicas)
        return ctx.target_replicas
    n = len(live)
    waiting = (sum(s.num_waiting for s in live) + ctx.queued_at_handles) / n
    kv = sum(s.kv_usage for s in live) / n
    ratio = max(waiting / config.target_waiting, kv / config.target_kv_usage)
    if abs(ratio - 1.0) <= config.tolerance:
        return ctx.target_replicas
    return _clamp(math.ceil(current * ratio), config.min_replicas, config.max_replicas)


class ThresholdAutoscaler:
    """HPA behaviour around `hpa_recommendation`: scale down to the highest recommendation
    of the last downscale_window_s; scale up at most max(2x, +4) per upscale_period_s."""

    def __init__(self, config: ThresholdConfig) -> None:
        self.config = config
        self.name = "keda-threshold"
        self._history: deque[tuple[float, int]] = deque()
        self._last_up: float = -math.inf

    def desired_replicas(self, ctx: ScalingContext) -> int:
        rec = hpa_recommendation(ctx, self.config)
        self._history.append((ctx.now, rec))
        while self._history and ctx.now - self._history[0][0] > self.config.downscale_window_s:
            self._history.popleft()
        current = ctx.target_replicas
        if rec > current:
            if ctx.now - self._last_up < self.config.upscale_period_s:
                return current
            self._last_up = ctx.now
            return min(rec, max(2 * current, current + 4))
        return min(current, max(r for _, r in self._history))


# ----------------------------------------------------------------------------- iterserve
class ServeScaleDown:
    """What Serve's controller does with a custom policy's scale-down (Ray 2.60,
    `ray.serve.autoscaling_policy._apply_delay_logic`, with the upscale and downscale
    delays iterserve sets to 0): a scale-down lands on at least 1 unless it starts from 1,
    and 1 -> 0 happens once the policy has asked for it on every tick for
    downscale_to_zero_delay_s (None: at once); a tick asking anything else restarts it."""

    def __init__(self, downscale_to_zero_delay_s: float | None) -> None:
        self.delay_s = downscale_to_zero_delay_s or 0.0
        self._since: float | None = None

    def apply(self, desired: int, target: int, now: float) -> int:
        if desired >= target:
            self._since = None
            return desired
        if target > 1:
            self._since = None
            return max(1, desired)
        self._since = now if self._since is None else self._since
        if now - self._since >= self.delay_s:
            self._since = None
            return desired
        return target


class IterserveAutoscaler:
    """iterserve's policy (`policy.decide`), its state carried between ticks as Serve's
    controller carries `policy_state` for `KVAutoscalingPolicy`, its answer applied as
    Serve applies it (`ServeScaleDown`)."""

    def __init__(self, config: AutoscaleConfig | None = None) -> None:
        self.config = config or AutoscaleConfig()
        self.name = "iterserve"
        self._state: dict[str, Any] = {}
        self._serve = ServeScaleDown(self.config.downscale_to_zero_delay_s)
        self.last_reason = ""

    def desired_replicas(self, ctx: ScalingContext) -> int:
        ctx = ScalingContext(ctx.now, ctx.current_replicas, ctx.target_replicas, ctx.signals,
                             ctx.queued_at_handles, self._state)
        decision, self._state = decide(ctx, self.config)
        self.last_reason = decision.reason
        return self._serve.apply(decision.desired, ctx.target_replicas, ctx.now)
