"""Every autoscaling baseline on hand-made situations."""

from __future__ import annotations

from iterserve.autoscale.autoscaling_policy import ReplicaSignal, ScalingContext
from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.sim.baseline_autoscalers import (
    FixedReplicas,
    IterserveAutoscaler,
    RayAutoscalingConfig,
    RayDefaultAutoscaler,
    ThresholdAutoscaler,
    ThresholdConfig,
    hpa_recommendation,
    ray_desired_replicas,
)


def sctx(now: float, n: int, waiting: float = 0.0, kv: float = 0.0, running: float = 0.0,
         target: int | None = None) -> ScalingContext:
    sig = {i: ReplicaSignal(kv_usage=kv, num_waiting=waiting, num_running=running)
           for i in range(n)}
    return ScalingContext(now=now, current_replicas=n, target_replicas=target or n,
                          signals=sig)


def test_fixed_never_moves():
    assert FixedReplicas(8).desired_replicas(sctx(0, 2, waiting=50)) == 8


def test_ray_formula():
    cfg = RayAutoscalingConfig(max_replicas=100)
    assert ray_desired_replicas(16, 2, cfg) == 8  # 16 ongoing / target 2 per replica
    assert ray_desired_replicas(4, 4, cfg) == 2
    assert ray_desired_replicas(5, 0, cfg) == 1
    assert ray_desired_replicas(1000, 2, RayAutoscalingConfig(max_replicas=8)) == 8


def test_ray_waits_its_delays_and_resets_on_a_calm_tick():
    p = RayDefaultAutoscaler(RayAutoscalingConfig(max_replicas=10))
    assert p.desired_replicas(sctx(0, 2, running=4)) == 2  # wants 4, delay starts
    assert p.desired_replicas(sctx(29, 2, running=4)) == 2
    assert p.desired_replicas(sctx(30, 2, running=4)) == 4
    assert p.desired_replicas(sctx(31, 4, running=0.5)) == 4  # wants fewer: 600 s delay
    assert p.desired_replicas(sctx(100, 4, running=2)) == 4  # calm tick resets
    assert p.desired_replicas(sctx(101, 4, running=0.5)) == 4
    assert p.desired_replicas(sctx(701, 4, running=0.5)) == 1


def test_hpa_recommendation_takes_the_worst_metric_within_tolerance():
    cfg = ThresholdConfig(max_replicas=20)
    assert hpa_recommendation(sctx(0, 4, waiting=6, kv=0.3), cfg) == 8  # waiting 2x target
    assert hpa_recommendation(sctx(0, 4, waiting=0, kv=0.9), cfg) == 6  # kv 1.5x
    assert hpa_recommendation(sctx(0, 4, waiting=3.2, kv=0.1), cfg) == 4  # within 10 %


def test_threshold_scales_up_limited_and_down_after_the_window():
    p = ThresholdAutoscaler(ThresholdConfig(max_replicas=64))
    assert p.desired_replicas(sctx(0, 2, waiting=30)) == 6  # rec 20, at most +4 / 2x
    assert p.desired_replicas(sctx(5, 6, waiting=30)) == 6  # within the 15 s period
    assert p.desired_replicas(sctx(16, 6, waiting=0.1, kv=0.1)) == 6  # window remembers 20
    assert p.desired_replicas(sctx(400, 6, waiting=0.1, kv=0.1)) == 1


def test_iterserve_autoscaler_keeps_decide_state_between_ticks():
    p = IterserveAutoscaler(AutoscaleConfig(max_replicas=10, upscale_delay_s=2.0))
    assert p.desired_replicas(sctx(0, 2, waiting=10)) == 2
    assert p.last_reason == "overloaded-waiting"
    # mean waiting 10 vs target 2: pressure 5, so 2 replicas become 10 in one step
    assert p.desired_replicas(sctx(2.5, 2, waiting=10)) == 10
