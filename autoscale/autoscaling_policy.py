"""KV- and queue-driven autoscaling with burst headroom: a pure policy over a context.

The rule
--------
Over the replicas that report metrics and are not draining (n of them):

    mean_waiting = (sum of engine waiting queues + requests queued at Serve handles) / n
    mean_kv      = mean KV usage
    running      = sum of running sequences (the cluster's load; about independent of n)
    overloaded   = mean_waiting > target_waiting_per_replica or mean_kv > kv_high_watermark
    needed       = max(ceil(running / low_running_per_replica),
                       the fewest replicas whose mean KV stays below kv_low_watermark)

Overloaded (the SLO is at risk now) continuously for upscale_delay_s: desired = target + k,
k = clamp(ceil(n * pressure) - target, 1, max_upscale_step), pressure = max(mean_waiting /
target_waiting_per_replica, mean_kv / kv_high_watermark).

The running sequences are kept as 5 s bucket means over the longer of headroom_window_s
and downscale_delay_s (the count is noisy: requests last seconds, and a threshold on raw
ticks reads the noise, more so on few replicas).

Headroom (room for a burst that arrives faster than a replica starts): the
headroom_quantile (0.25) of the history over headroom_window_s (60 s) is the *sustained*
load, which a burst shorter than (1 - quantile) x window (45 s) does not move: that burst
is what the headroom is for, and replicas started for it would come a start-up later.
Sustained running per target replica above high_running_per_replica: desired =
ceil(sustained / low_running_per_replica), at least one more and at most
max_upscale_step more.

Look-ahead (startup_s, the served model's measured start-up: a replica asked for now serves
startup_s later). The sustained load is projected that far along its trend:

    sustained_ahead = sustained + max(0, slope) x startup_s
    slope = least-squares slope of the 5 s bucket means over headroom_window_s

and the headroom rule reads sustained_ahead in place of sustained: with load growing by g
sequences/s, replicas are added g x startup_s sequences before the threshold, so a model that
starts in 60 s scales a minute of growth early, one that starts in 5 s, 5 s early. Without
startup_s (None) nothing is projected.

While replicas are still starting (target > current) both scale-ups hold: the load has not
had a chance to spread yet, and stacking decisions on stale metrics overshoots.

Underloaded: mean_waiting <= low_waiting_per_replica and `needed`, taken over the
1 - headroom_quantile (0.75) quantile of the history over downscale_delay_s, below target;
once downscale_delay_s has passed since this policy last changed the target (and the
history covers it): desired = needed, in one step. A blip does not restart anything; the
upper quantile keeps the step safe. Between low_running_per_replica (where scaling lands)
and high_running_per_replica (where headroom adds) nothing moves. The result is clamped
to [min_replicas, max_replicas].

Zero replicas (min_replicas 0). Requests queued at the handles (`queued_at_handles`) are
never left without a replica: with none running the policy asks for one at once
("scale-from-zero", what Serve's controller also does before any custom policy runs), and
it never asks for 0 while anything is queued. The way down to 0 is Serve's: the policy
asks for 0 when nothing runs; Serve lands a larger target on 1 first and holds 1 -> 0 for
`downscale_to_zero_delay_s` of consecutive asks, so a scale-down the controller held is
asked again on every tick (not held for another downscale_delay_s), until the target
reaches it or the load comes back.

The Ray adapter (`KVAutoscalingPolicy`) turns Serve's `AutoscalingContext` into a
`ScalingContext`; the history rides in Serve's `policy_state` (plain JSON lists). Serve's
own upscale/downscale delays must be 0 (see `serve_autoscaling_config`): this policy owns
the hysteresis, Serve would add its delays on top.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.signals import (
    METRIC_DRAINING,
    METRIC_KV_USAGE,
    METRIC_NUM_RUNNING,
    METRIC_NUM_WAITING,
)

STATE_OVER_SINCE = "iterserve_over_since"
STATE_LAST_REASON = "iterserve_last_reason"
STATE_CHANGED_AT = "iterserve_changed_at"  # when this policy last changed the target
STATE_ASKED_DOWN = "iterserve_asked_down"  # a scale-down asked and not reached yet
STATE_RUNNING_HISTORY = "iterserve_running_history"  # [[start, mean running, ticks], ...]
HISTORY_STEP_S = 5.0  # one history entry per 5 s: 12 entries for a 60 s window


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


def _replicas_needed(running: float, total_kv: float, config: AutoscaleConfig) -> float:
    """The fewest replicas that carry `running` sequences at low_running_per_replica each
    and hold `total_kv` (summed KV usage) below kv_low_watermark each (inf: no count does)."""
    if running <= 0:
        by_running = 0.0
    elif config.low_running_per_replica > 0:
        by_running = float(math.ceil(running / config.low_running_per_replica))
    else:
        by_running = math.inf
    if total_kv <= 0:
        by_kv = 0.0
    elif config.kv_low_watermark > 0:
        by_kv = float(math.floor(total_kv / config.kv_low_watermark) + 1)
    else:
        by_kv = math.inf
    return max(by_running, by_kv)


def _record_running(history: list[list[float]], now: float, running: float,
                    keep_s: float) -> list[list[float]]:
    """[[bucket start, mean running sequences, ticks], ...], one entry per HISTORY_STEP_S,
    covering the last keep_s: the oldest entry kept is the newest that started at or
    before now - keep_s, so a window's start is known. Bucket means, not ticks: the count
    of running sequences is noisy (requests last seconds), and a quantile of raw ticks
    would read the noise, more so on few replicas."""
    kept = [list(entry) for entry in history]
    if kept and now - kept[-1][0] < HISTORY_STEP_S:
        start, mean, ticks = kept[-1]
        kept[-1] = [start, mean + (running - mean) / (ticks + 1), ticks + 1]
    else:
        kept.append([now, running, 1])
    while len(kept) > 1 and kept[1][0] <= now - keep_s:
        kept.pop(0)
    return kept


def _window_quantile(history: list[list[float]], now: float, window_s: float,
                     q: float) -> float | None:
    """The q-quantile of the running sequences over the last window_s (the entry in force
    at its start included); None until the history covers the window."""
    if not history or now - history[0][0] < window_s:
        return None
    start = max(i for i, entry in enumerate(history) if entry[0] <= now - window_s)
    return percentile([entry[1] for entry in history[start:]], 100.0 * q)


def _window_trend(history: list[list[float]], now: float, window_s: float) -> float:
    """Growth of the running sequences per second over the last window_s: the least-squares
    slope of its bucket means; 0 until the window is covered or while the load falls."""
    if not history or now - history[0][0] < window_s:
        return 0.0
    start = max(i for i, entry in enumerate(history) if entry[0] <= now - window_s)
    points = [(entry[0], entry[1]) for entry in history[start:]]
    if len(points) < 3:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / spread
    return max(0.0, slope)


def decide(ctx: ScalingContext, config: AutoscaleConfig) -> tuple[ScalingDecision, dict[str, Any]]:
    """The policy with its reasoning; `desired_replicas` is the short form."""
    state: dict[str, Any] = dict(ctx.policy_state)
    over_since = state.get(STATE_OVER_SINCE)
    target = max(ctx.target_replicas, 0)
    live = [s for s in ctx.signals.values() if not s.draining]

    queued = max(0.0, ctx.queued_at_handles)
    asked_down = state.get(STATE_ASKED_DOWN)
    if asked_down is not None and asked_down >= target:
        asked_down = None  # reached (or the target moved up meanwhile)

    if not live:
        # No metrics yet (replicas starting), everything draining, or no replica at all:
        # hold, unless below min or requests wait at the handles with no replica to go to.
        state[STATE_OVER_SINCE] = None
        state[STATE_ASKED_DOWN] = None
        desired, reason = _clamp(target, config), "no-metrics"
        if desired < 1 and queued > 0:
            desired, reason = 1, "scale-from-zero"
        if desired != target:
            state[STATE_CHANGED_AT] = ctx.now
        state[STATE_LAST_REASON] = reason
        return ScalingDecision(desired, reason, 0.0, 0.0), state

    n = len(live)
    mean_waiting = (sum(s.num_waiting for s in live) + queued) / n
    mean_kv = sum(s.kv_usage for s in live) / n
    history = _record_running(
        state.get(STATE_RUNNING_HISTORY) or [], ctx.now, sum(s.num_running for s in live),
        max(config.headroom_window_s, config.downscale_delay_s))
    state[STATE_RUNNING_HISTORY] = history
    # a decision's window starts no earlier than the last change: older load ran on
    # another replica count
    changed_at = state.get(STATE_CHANGED_AT)
    since_change = math.inf if changed_at is None else ctx.now - changed_at
    sustained = _window_quantile(history, ctx.now, config.headroom_window_s,
                                 config.headroom_quantile)
    if sustained is not None and config.startup_s is not None:  # look startup_s ahead
        sustained += _window_trend(history, ctx.now, config.headroom_window_s) * config.startup_s
    peak = _window_quantile(history, ctx.now, config.downscale_delay_s,
                            1.0 - config.headroom_quantile)
    overloaded = (
        mean_waiting > config.target_waiting_per_replica or mean_kv > config.kv_high_watermark
    )
    short_of_headroom = (
        sustained is not None and target > 0
        and sustained / target > config.high_running_per_replica
    )
    running = history[-1][1] if peak is None else peak  # the window not covered yet
    needed = _replicas_needed(running, mean_kv * n, config)
    underloaded = mean_waiting <= config.low_waiting_per_replica and needed < target

    desired = target
    reason = "steady"
    if overloaded:
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
    elif short_of_headroom and sustained is not None:
        over_since = None
        if target > ctx.current_replicas:
            reason = "headroom-replicas-starting"
        else:
            want = math.ceil(sustained / max(config.low_running_per_replica, 1e-9))
            desired = target + min(max(want - target, 1), config.max_upscale_step)
            reason = "headroom-scale-up"
    elif underloaded and target > config.min_replicas:
        over_since = None
        if asked_down is not None:  # Serve holds it (1 -> 0 delay): ask it again
            desired = max(int(asked_down), int(needed))
            reason = "scale-down-held"
        elif since_change < config.downscale_delay_s or peak is None:
            reason = "underloaded-waiting"
        else:
            desired = int(needed)
            reason = "scale-down"
    else:
        over_since = None

    clamped = _clamp(desired, config)
    if clamped != desired:
        reason = f"{reason}-bounded"
    if clamped < 1 and queued > 0:  # never strand requests queued at the handles
        clamped, reason = 1, f"{reason}-queued"
    if clamped != target and clamped != asked_down:  # a new change, not one asked again
        state[STATE_CHANGED_AT] = ctx.now
    state[STATE_ASKED_DOWN] = clamped if clamped < target else None
    state[STATE_OVER_SINCE] = over_since
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

    Serve's delays are 0 because the policy owns hysteresis, except the last replica's
    (`downscale_to_zero_delay_s`, Serve's, passed through); aggregation is "mean" over a
    short look-back window. Also export `autoscaling_env_vars(config)` to the Ray cluster
    (controller and replicas) before `ray.init` / `ray start`.
    """
    return {
        "min_replicas": config.min_replicas,
        "initial_replicas": config.min_replicas if config.min_replicas > 0 else None,
        "max_replicas": config.max_replicas,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "downscale_to_zero_delay_s": config.downscale_to_zero_delay_s,
        # Deprecated but validated: look_back_period_s must exceed it (default 10 s).
        "metrics_interval_s": config.metrics_push_interval_s,
        "look_back_period_s": config.look_back_period_s,
        "aggregation_function": "mean",
        "policy": {
            "policy_function": "iterserve.autoscale.autoscaling_policy:KVAutoscalingPolicy",
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
