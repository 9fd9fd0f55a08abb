"""KV- and queue-driven autoscaling: a pure policy over a context, with hysteresis.

The rule
--------
Over the replicas that report metrics and are not draining (n of them):

    mean_waiting = (sum of engine waiting queues + requests queued at Serve handles) / n
    mean_kv      = mean KV usage
    overloaded   = mean_waiting > target_waiting_per_replica or mean_kv > kv_high_watermark
    underloaded  = mean_waiting <= low_waiting_per_replica
                   and mean_kv * n / (n - 1) < kv_low_watermark     (the load after removing one)
                   and mean_running * n / (n - 1) <= low_running_per_replica

Overloaded continuously for upscale_delay_s: desired = target + k, where
k = clamp(ceil(n * pressure) - target, 1, max_upscale_step) and
pressure = max(mean_waiting / target_waiting_per_replica, mean_kv / kv_high_watermark).
While replicas are still starting (target > current) the policy holds: the load has not
had a chance to spread yet, and stacking decisions on stale metrics overshoots.
Underloaded continuously for downscale_delay_s: desired = target - 1, and the timer
restarts, so each further step waits another downscale_delay_s. Anything in between
resets both timers. The result is clamped to [min_replicas, max_replicas].

The Ray adapter (`KVAutoscalingPolicy`) turns Serve's `AutoscalingContext` into a
`ScalingContext`. Serve's own upscale/downscale delays must be 0 (see
`serve_autoscaling_config`): this policy owns the hysteresis, Serve would add its delays
on top.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.signals import (
    METRIC_DRAINING,
    METRIC_KV_USAGE,
    METRIC_NUM_RUNNING,
    METRIC_NUM_WAITING,
)

STATE_OVER_SINCE = "iterserve_over_since"
STATE_UNDER_SINCE = "iterserve_under_since"
STATE_LAST_REASON = "iterserve_last_reason"


@dataclass(frozen=True)
class ReplicaSignal:
    """What the autoscaler knows of one replica (aggregated over Serve's look-back window)."""

    kv_usage: float
    num_waiting: float
    num_running: float = 0.0
    draining: bool = False


@dataclass(frozen=True)
class ScalingContext:
    """Everything `desired_replicas` reads. `now` is the caller's clock (seconds)."""

    now: float
    current_replicas: int  # running replicas
    target_replicas: int  # what Serve currently aims for (>= current while scaling up)
    signals: Mapping[Hashable, ReplicaSignal]  # per running replica that reported metrics
    queued_at_handles: float = 0.0  # requests waiting in Serve handles, not yet at a replica
    policy_state: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScalingDecision:
    desired: int
    reason: str
    mean_waiting: float
    mean_kv: float


def _clamp(n: int, config: AutoscaleConfig) -> int:
    return max(config.min_replicas, min(config.max_replicas, n))


def _running_after_removal(live: list[ReplicaSignal]) -> float:
    """Mean running sequences per replica with one replica fewer (inf for the last busy one)."""
    total = sum(s.num_running for s in live)
    if len(live) > 1:
        return total / (len(live) - 1)
    return 0.0 if total == 0 else math.inf


def decide(ctx: ScalingContext, config: AutoscaleConfig) -> tuple[ScalingDecision, dict[str, Any]]:
    """The policy with its reasoning; `desired_replicas` is the short form."""
    state: dict[str, Any] = dict(ctx.policy_state)
    over_since = state.get(STATE_OVER_SINCE)
    under_since = state.get(STATE_UNDER_SINCE)
    target = max(ctx.target_replicas, 0)
    live = [s for s in ctx.signals.values() if not s.draining]

    if not live:
        # No metrics yet (replicas starting) or everything draining: hold, unless below min.
        state[STATE_OVER_SINCE] = None
        state[STATE_UNDER_SINCE] = None
        decision = ScalingDecision(_clamp(target, config), "no-metrics", 0.0, 0.0)
        state[STATE_LAST_REASON] = decision.reason
        return decision, state

    n = len(live)
    mean_waiting = (sum(s.num_waiting for s in live) + max(0.0, ctx.queued_at_handles)) / n
    mean_kv = sum(s.kv_usage for s in live) / n
    overloaded = (
        mean_waiting > config.target_waiting_per_replica or mean_kv > config.kv_high_watermark
    )
    if n > 1:
        kv_after_removal = mean_kv * n / (n - 1)
    else:  # one replica left: only an idle one may go (to min_replicas = 0)
        idle = mean_kv == 0.0 and all(s.num_running == 0 for s in live)
        kv_after_removal = 0.0 if idle else math.inf
    underloaded = (
        mean_waiting <= config.low_waiting_per_replica
        and kv_after_removal < config.kv_low_watermark
        and _running_after_removal(live) <= config.low_running_per_replica
    )

    desired = target
    reason = "steady"
    if overloaded:
        under_since = None
        over_since = ctx.now if over_since is None else over_since
        if ctx.now - over_since < config.upscale_delay_s:
            reason = "overloaded-waiting"
        elif target > ctx.current_replicas:
            reason = "overloaded-replicas-starting"
        else:
            pressure = max(
                mean_waiting / config.target_waiting_per_replica,
                mean_kv / config.kv_high_watermark,
            )
            step = min(max(math.ceil(n * pressure) - target, 1), config.max_upscale_step)
            desired = target + step
            reason = "scale-up"
            over_since = ctx.now  # the next step needs another full upscale_delay_s
    elif underloaded and target > config.min_replicas:
        over_since = None
        under_since = ctx.now if under_since is None else under_since
        if ctx.now - under_since < config.downscale_delay_s:
            reason = "underloaded-waiting"
        else:
            desired = target - 1
            reason = "scale-down"
            under_since = ctx.now
    else:
        over_since = None
        under_since = None

    clamped = _clamp(desired, config)
    if clamped != desired:
        reason = f"{reason}-bounded"
    state[STATE_OVER_SINCE] = over_since
    state[STATE_UNDER_SINCE] = under_since
    state[STATE_LAST_REASON] = reason
    return ScalingDecision(clamped, reason, mean_waiting, mean_kv), state


def desired_replicas(ctx: ScalingContext, config: AutoscaleConfig) -> tuple[int, dict[str, Any]]:
    """(desired replica count, new policy state). Pure: same inputs, same answer."""
    decision, state = decide(ctx, config)
    return decision.desired, state


# --------------------------------------------------------------------------- Ray adapter


def context_from_serve(ctx: Any, config: AutoscaleConfig) -> ScalingContext:  # noqa: ANN401
    """Translate Serve's `ray.serve.config.AutoscalingContext` (duck-typed: no Ray import).

    Reads `aggregated_metrics[name][replica_id]` for the metrics `ReplicaLoad.
    to_autoscaling_metrics()` reports; a replica whose newest raw sample is older than
    config.stats_stale_after_s is left out (treated as not reporting).
    """
    now = float(ctx.current_time) if ctx.current_time is not None else 0.0
    metrics = ctx.aggregated_metrics or {}
    raw = ctx.raw_metrics or {}
    kv = metrics.get(METRIC_KV_USAGE, {})
    waiting = metrics.get(METRIC_NUM_WAITING, {})
    running = metrics.get(METRIC_NUM_RUNNING, {})
    draining = metrics.get(METRIC_DRAINING, {})
    kv_raw = raw.get(METRIC_KV_USAGE, {})
    signals: dict[Hashable, ReplicaSignal] = {}
    for rid in ctx.running_replicas:
        if rid not in kv or rid not in waiting:
            continue
        series = kv_raw.get(rid) or []
        newest = max((s.timestamp for s in series), default=None)
        if newest is not None and now and now - newest > config.stats_stale_after_s:
            continue
        signals[rid] = ReplicaSignal(
            kv_usage=float(kv[rid]),
            num_waiting=float(waiting[rid]),
            num_running=float(running.get(rid, 0.0)),
            draining=float(draining.get(rid, 0.0)) >= 0.5,
        )
    queued = ctx.total_queued_requests
    return ScalingContext(
        now=now,
        current_replicas=int(ctx.current_num_replicas),
        target_replicas=int(ctx.target_num_replicas),
        signals=signals,
        queued_at_handles=float(queued) if queued is not None else 0.0,
        policy_state=dict(ctx.policy_state or {}),
    )


class KVAutoscalingPolicy:
    """Serve class-form policy: `AutoscalingPolicy(policy_function=KVAutoscalingPolicy,
    policy_kwargs=AutoscaleConfig(...).model_dump())`. Serve builds it once on the
    controller with policy_kwargs and calls it with an AutoscalingContext every tick."""

    def __init__(self, **policy_kwargs: Any) -> None:  # noqa: ANN401
        from iterserve.dashboards.metrics import AutoscalerMetrics

        self.config = AutoscaleConfig(**policy_kwargs)
        self._metrics = AutoscalerMetrics(self.config.model_name)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:  # noqa: ANN401
        target, state = desired_replicas(context_from_serve(ctx, self.config), self.config)
        self._metrics.set_target_replicas(target)
        return target, state


def serve_autoscaling_config(config: AutoscaleConfig) -> dict[str, Any]:
    """The `autoscaling_config=` dict for `@serve.deployment` / `.options()` / YAML.

    Serve's delays are 0 because the policy owns hysteresis; aggregation is "mean" over a
    short look-back window. Also export `autoscaling_env_vars(config)` to the Ray cluster
    (controller and replicas) before `ray.init` / `ray start`.
    """
    return {
        "min_replicas": config.min_replicas,
        "initial_replicas": config.min_replicas if config.min_replicas > 0 else None,
        "max_replicas": config.max_replicas,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        # Deprecated but validated: look_back_period_s must exceed it (default 10 s).
        "metrics_interval_s": config.metrics_push_interval_s,
        "look_back_period_s": config.look_back_period_s,
        "aggregation_function": "mean",
        "policy": {
            "policy_function": "iterserve.autoscale.policy:KVAutoscalingPolicy",
            "policy_kwargs": config.model_dump(),
        },
    }


def autoscaling_env_vars(config: AutoscaleConfig) -> dict[str, str]:
    """Environment Serve reads at import time in the controller and replicas."""
    push = str(config.metrics_push_interval_s)
    return {
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": push,
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": push,
    }
