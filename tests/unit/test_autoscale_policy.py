"""desired_replicas over hand-built ScalingContexts: hysteresis, bounds, no clock reads."""

from __future__ import annotations

import pytest

from iterserve.autoscale.autoscaling_policy import (
    KVAutoscalingPolicy,
    ReplicaSignal,
    ScalingContext,
    decide,
    desired_replicas,
    serve_autoscaling_config,
)
from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.signals import ReplicaLoad

CFG = AutoscaleConfig(min_replicas=1, max_replicas=6, upscale_delay_s=2.0,
                      downscale_delay_s=10.0, max_upscale_step=2)
HOT = ReplicaSignal(kv_usage=0.95, num_waiting=0)
QUEUED = ReplicaSignal(kv_usage=0.5, num_waiting=6)
MID = ReplicaSignal(kv_usage=0.6, num_waiting=1)
IDLE = ReplicaSignal(kv_usage=0.05, num_waiting=0)


def ctx(now, signals, current=None, target=None, state=None, queued=0.0):
    n = len(signals)
    return ScalingContext(
        now=now, current_replicas=n if current is None else current,
        target_replicas=n if target is None else target,
        signals={f"r{i}": s for i, s in enumerate(signals)}, queued_at_handles=queued,
        policy_state=state or {},
    )


def run(timeline, config=CFG):
    """timeline: [(now, signals, current, target)] -> decisions, carrying the state."""
    state: dict = {}
    out = []
    for now, signals, current, target in timeline:
        n, state = desired_replicas(ctx(now, signals, current, target, state), config)
        out.append(n)
    return out


def test_scale_up_only_after_overload_lasts_upscale_delay():
    t = [(0.0, [HOT], 1, 1), (1.0, [HOT], 1, 1), (2.0, [HOT], 1, 1)]
    assert run(t) == [1, 1, 2]


def test_a_blip_resets_the_upscale_timer():
    t = [(0.0, [HOT], 1, 1), (1.5, [MID], 1, 1), (2.5, [HOT], 1, 1), (4.0, [HOT], 1, 1),
         (4.5, [HOT], 1, 1)]
    assert run(t) == [1, 1, 1, 1, 2]


def test_waiting_queue_pressure_scales_proportionally_capped_by_step():
    # mean waiting 6 vs target 2 -> pressure 3 -> 2 replicas want 6, capped at +2
    state: dict = {}
    _, state = desired_replicas(ctx(0.0, [QUEUED, QUEUED], state=state), CFG)
    n, _ = desired_replicas(ctx(2.0, [QUEUED, QUEUED], state=state), CFG)
    assert n == 4


def test_requests_queued_at_handles_count_as_waiting():
    calm = [ReplicaSignal(kv_usage=0.5, num_waiting=0)]
    d, _ = decide(ctx(0.0, calm, queued=10.0), CFG)
    assert d.reason == "overloaded-waiting" and d.mean_waiting == 10.0


def test_holds_while_new_replicas_are_starting():
    t = [(0.0, [HOT], 1, 2), (3.0, [HOT], 1, 2)]
    assert run(t) == [2, 2]
    d, _ = decide(ctx(3.0, [HOT], 1, 2, state={"iterserve_over_since": 0.0}), CFG)
    assert d.reason == "overloaded-replicas-starting"


def test_scale_down_lands_on_the_need_after_downscale_delay():
    # idle: KV 0.15 in all fits one replica below kv_low_watermark; no running sequences
    idle3 = [IDLE, IDLE, IDLE]
    t = [(0.0, idle3, 3, 3), (9.0, idle3, 3, 3), (10.0, idle3, 3, 3)]
    assert run(t) == [3, 3, 1]
    # 6 replicas running 2 each: 12 sequences need 2 replicas at low_running (6) each
    busy = [ReplicaSignal(0.05, 0, num_running=2)] * 6
    assert run([(0.0, busy, 6, 6), (10.0, busy, 6, 6)]) == [6, 2]


def test_each_further_scale_down_waits_another_downscale_delay():
    four = [ReplicaSignal(0.05, 0, num_running=3)] * 4  # 12 running: need 2
    two = [ReplicaSignal(0.0, 0, num_running=0)] * 2  # idle: need 1 (min)
    t = [(0.0, four, 4, 4), (10.0, four, 4, 4), (15.0, two, 2, 2), (19.9, two, 2, 2),
         (20.0, two, 2, 2)]
    assert run(t) == [4, 2, 2, 2, 1]


def test_a_blip_in_the_running_count_does_not_stop_a_scale_down():
    # a tick where every replica runs 10 (40 in all: all 4 replicas needed) inside the window
    calm = [ReplicaSignal(0.05, 0, num_running=1)] * 4
    blip = [ReplicaSignal(0.05, 0, num_running=10)] * 4
    t = [(i * 0.5, blip if i == 6 else calm, 4, 4) for i in range(21)]
    assert run(t)[-1] == 1  # the 5 s bucket's mean and the window's quantile absorb it


def test_no_scale_down_while_the_load_needs_every_replica():
    busy = [ReplicaSignal(0.05, 0, num_running=7)] * 3  # 21 running need 4 > 3
    assert run([(t, busy, 3, 3) for t in (0.0, 10.0, 30.0)]) == [3, 3, 3]


def test_no_scale_down_when_the_remaining_replicas_would_run_hot():
    # mean kv 0.3 over 2 replicas -> 0.6 on one: above kv_low_watermark (0.4)
    t = [(0.0, [ReplicaSignal(0.3, 0), ReplicaSignal(0.3, 0)], 2, 2),
         (100.0, [ReplicaSignal(0.3, 0), ReplicaSignal(0.3, 0)], 2, 2)]
    assert run(t) == [2, 2]


def test_no_scale_down_that_would_spend_the_burst_headroom():
    # KV and queues idle, but 3 replicas each running 6 sequences: 9 each on two replicas,
    # above low_running_per_replica (8): the spare concurrency for a burst stays
    cfg = AutoscaleConfig(**{**CFG.model_dump(), "low_running_per_replica": 8.0,
                             "high_running_per_replica": 12.0})
    busy = [ReplicaSignal(0.05, 0, num_running=6)] * 3
    assert run([(0.0, busy, 3, 3), (100.0, busy, 3, 3)], cfg) == [3, 3]
    # 5 each -> 7.5 on two: at most 8, so one goes after the delay
    calm = [ReplicaSignal(0.05, 0, num_running=5)] * 3
    assert run([(0.0, calm, 3, 3), (10.0, calm, 3, 3)], cfg) == [3, 2]
    # the last replica is never 'underloaded' while it runs anything
    one = [ReplicaSignal(0.0, 0, num_running=1)]
    cfg0 = AutoscaleConfig(**{**cfg.model_dump(), "min_replicas": 0})
    assert run([(0.0, one, 1, 1), (100.0, one, 1, 1)], cfg0) == [1, 1]


HEADROOM = AutoscaleConfig(min_replicas=1, max_replicas=16, downscale_delay_s=10.0,
                           low_running_per_replica=6.0, high_running_per_replica=8.0,
                           headroom_window_s=60.0, headroom_quantile=0.25)


def timeline(signals_at, until: float, step: float = 1.0, replicas: int = 2):
    """Ticks every `step` s from 0 to `until`, each replica's running from signals_at(t)."""
    out = []
    for i in range(int(until / step) + 1):
        t = i * step
        out.append((t, [ReplicaSignal(0.05, 0, num_running=signals_at(t))] * replicas,
                    replicas, replicas))
    return out


def test_headroom_scale_up_once_the_sustained_running_exceeds_high():
    # 2 replicas running 10 each (above 8) for a whole window: 20 / 6 -> 4 replicas
    decisions = run(timeline(lambda t: 10.0, 60.0), HEADROOM)
    assert decisions[-1] == 4
    assert all(d == 2 for d in decisions[:-1])  # nothing before the window is covered


def test_a_burst_shorter_than_the_window_quantile_adds_no_headroom():
    # 5 running each (below 8, above what 1 replica would run at 6), then 30 each for 30 s:
    # the 25th percentile of the window is the calm before
    burst = run(timeline(lambda t: 30.0 if t >= 30 else 5.0, 60.0), HEADROOM)
    assert burst[-1] == 2
    # the same level sustained over most of the window is load, not a burst
    sustained = run(timeline(lambda t: 30.0 if t >= 10 else 5.0, 60.0), HEADROOM)
    assert sustained[-1] > 2


def test_look_ahead_scales_a_slow_starting_model_earlier():
    """Running sequences growing 0.1/s per replica: at 60 s the sustained load (6.5 per
    replica) is below high_running_per_replica (8); projected 30 s ahead along its trend it is
    9.5: a model that starts in 30 s scales now, one that starts in 5 s (7.0) does not yet."""
    growing = timeline(lambda t: 5.0 + 0.1 * t, 60.0)
    assert run(growing, HEADROOM)[-1] == 2  # no look-ahead: nothing yet
    slow = AutoscaleConfig(**{**HEADROOM.model_dump(), "startup_s": 30.0})
    fast = AutoscaleConfig(**{**HEADROOM.model_dump(), "startup_s": 5.0})
    assert run(growing, slow)[-1] == 4  # ceil(19 / 6)
    assert run(growing, fast)[-1] == 2
    # a falling load projects nothing (the trend counts growth only)
    falling = timeline(lambda t: 11.0 - 0.1 * t, 60.0)
    assert run(falling, slow)[-1] == run(falling, HEADROOM)[-1]


def test_headroom_holds_while_replicas_start():
    t = timeline(lambda t: 20.0, 60.0)
    t[-1] = (60.0, t[-1][1], 2, 3)  # target 3, 2 running: the last decision holds
    state: dict = {}
    for now, signals, current, target in t:
        decision, state = decide(ctx(now, signals, current, target, state), HEADROOM)
    assert decision.desired == 3 and decision.reason == "headroom-replicas-starting"


def test_policy_state_is_plain_json():
    import json

    state: dict = {}
    for now, signals, current, target in timeline(lambda t: 10.0, 70.0):
        _, state = desired_replicas(ctx(now, signals, current, target, state), HEADROOM)
    assert json.loads(json.dumps(state)) == state
    # one history entry per 5 s, covering the longest window (60 s) and no more
    assert 12 <= len(state["iterserve_running_history"]) <= 14


def test_bounds():
    cfg = AutoscaleConfig(min_replicas=2, max_replicas=3, upscale_delay_s=0,
                          downscale_delay_s=0)
    n, _ = desired_replicas(ctx(0.0, [HOT, HOT, HOT]), cfg)
    assert n == 3
    n, _ = desired_replicas(ctx(0.0, [IDLE, IDLE]), cfg)
    assert n == 2
    n, _ = desired_replicas(ctx(0.0, [], current=0, target=0), cfg)  # below min, no metrics
    assert n == 2


def test_no_metrics_holds_target():
    d, state = decide(ctx(5.0, [], current=2, target=2), CFG)
    assert d.desired == 2 and d.reason == "no-metrics"
    assert state["iterserve_over_since"] is None


def test_draining_replicas_are_ignored():
    sig = [ReplicaSignal(0.99, 9, draining=True), IDLE, IDLE]
    d, _ = decide(ctx(0.0, sig), CFG)
    assert d.reason == "underloaded-waiting"


def test_policy_is_pure_and_keeps_foreign_state_keys():
    c = ctx(0.0, [HOT], state={"__decision_counters": 3})
    a = desired_replicas(c, CFG)
    b = desired_replicas(c, CFG)
    assert a == b and a[1]["__decision_counters"] == 3
    assert c.policy_state == {"__decision_counters": 3}


def test_config_validation():
    with pytest.raises(ValueError):
        AutoscaleConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        AutoscaleConfig(kv_low_watermark=0.9, kv_high_watermark=0.8)
    with pytest.raises(ValueError):
        AutoscaleConfig(low_waiting_per_replica=3, target_waiting_per_replica=2)
    with pytest.raises(ValueError):
        AutoscaleConfig(low_running_per_replica=8, high_running_per_replica=8)


def test_ray_adapter_reads_serve_autoscaling_context():
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    cfg = AutoscaleConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0.0)
    dep = DeploymentID("LLMReplica", "app")
    reps = [ReplicaID("a", dep), ReplicaID("b", dep)]
    hot = ReplicaLoad(0.95, 3, 5, 10, 200, 0.0, 99.0).to_autoscaling_metrics()
    agg = {name: {r: hot[name] for r in reps} for name in hot}
    raw = {name: {r: [TimeStampedValue(99.0, hot[name])] for r in reps} for name in hot}
    serve_cfg = AutoscalingConfig(**serve_autoscaling_config(cfg))
    sctx = AutoscalingContext(
        deployment_id=dep, deployment_name="LLMReplica", app_name="app",
        current_num_replicas=2, target_num_replicas=2, running_replicas=reps,
        total_num_requests=16.0, total_queued_requests=0.0, aggregated_metrics=agg,
        raw_metrics=raw, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=100.0, config=serve_cfg,
    )
    policy = KVAutoscalingPolicy(**cfg.model_dump())
    n, state = policy(sctx)
    # pressure = max(mean waiting 3 / 2, kv 0.95 / 0.85) = 1.5 -> ceil(2 * 1.5) = 3
    assert n == 3 and state["iterserve_last_reason"] == "scale-up"
    wrapped = _apply_autoscaling_config(policy)  # what Serve runs: delays 0, so no change
    n2, _ = wrapped(sctx)
    assert n2 == 3
    # metrics older than stats_stale_after_s are ignored -> no metrics -> hold
    sctx.current_time = 1000.0
    n3, state3 = KVAutoscalingPolicy(**cfg.model_dump())(sctx)
    assert n3 == 2 and state3["iterserve_last_reason"] == "no-metrics"
