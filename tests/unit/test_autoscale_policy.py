"""desired_replicas over hand-built ScalingContexts: hysteresis, bounds, no clock reads."""

from __future__ import annotations

import pytest

from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.policy import (
    KVAutoscalingPolicy,
    ReplicaSignal,
    ScalingContext,
    decide,
    desired_replicas,
    serve_autoscaling_config,
)
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


def test_scale_down_one_at_a_time_after_downscale_delay():
    idle3 = [IDLE, IDLE, IDLE]
    idle2 = [IDLE, IDLE]
    t = [(0.0, idle3, 3, 3), (9.0, idle3, 3, 3), (10.0, idle3, 3, 3),
         (11.0, idle2, 2, 2), (19.9, idle2, 2, 2), (20.0, idle2, 2, 2), (40.0, [IDLE], 1, 1)]
    assert run(t) == [3, 3, 2, 2, 2, 1, 1]


def test_no_scale_down_when_the_remaining_replicas_would_run_hot():
    # mean kv 0.3 over 2 replicas -> 0.6 on one: above kv_low_watermark (0.4)
    t = [(0.0, [ReplicaSignal(0.3, 0), ReplicaSignal(0.3, 0)], 2, 2),
         (100.0, [ReplicaSignal(0.3, 0), ReplicaSignal(0.3, 0)], 2, 2)]
    assert run(t) == [2, 2]


def test_no_scale_down_that_would_spend_the_burst_headroom():
    # KV and queues idle, but 3 replicas each running 6 sequences: 9 each on two replicas,
    # above low_running_per_replica (8): the spare concurrency for a burst stays
    cfg = AutoscaleConfig(**{**CFG.model_dump(), "low_running_per_replica": 8.0})
    busy = [ReplicaSignal(0.05, 0, num_running=6)] * 3
    assert run([(0.0, busy, 3, 3), (100.0, busy, 3, 3)], cfg) == [3, 3]
    # 5 each -> 7.5 on two: at most 8, so one goes after the delay
    calm = [ReplicaSignal(0.05, 0, num_running=5)] * 3
    assert run([(0.0, calm, 3, 3), (10.0, calm, 3, 3)], cfg) == [3, 2]
    # the last replica is never 'underloaded' while it runs anything
    one = [ReplicaSignal(0.0, 0, num_running=1)]
    cfg0 = AutoscaleConfig(**{**cfg.model_dump(), "min_replicas": 0})
    assert run([(0.0, one, 1, 1), (100.0, one, 1, 1)], cfg0) == [1, 1]


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
