"""Zero replicas: the policy's rule (scale from zero when requests wait, never strand them),
Serve's own scale-down rules as the simulator applies them (checked against Ray's wrapper),
and the simulator starting from zero with nothing special-cased."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from iterserve.autoscale.autoscaling_policy import (
    KVAutoscalingPolicy,
    ReplicaSignal,
    ScalingContext,
    decide,
    serve_autoscaling_config,
)
from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.baseline_autoscalers import (
    IterserveAutoscaler,
    RayAutoscalingConfig,
    RayDefaultAutoscaler,
    ServeScaleDown,
    ThresholdAutoscaler,
    ThresholdConfig,
)
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.policies import IterserveRouter
from iterserve.autoscale.sim.workload import WorkloadRequest

ZERO = AutoscaleConfig(min_replicas=0, max_replicas=4, downscale_delay_s=5.0,
                       downscale_to_zero_delay_s=20.0)
IDLE = ReplicaSignal(kv_usage=0.0, num_waiting=0.0, num_running=0.0)


def ctx(now: float, signals: list[ReplicaSignal], target: int, queued: float = 0.0,
        state: dict | None = None, current: int | None = None) -> ScalingContext:
    return ScalingContext(now=now, current_replicas=len(signals) if current is None else current,
                          target_replicas=target,
                          signals={f"r{i}": s for i, s in enumerate(signals)},
                          queued_at_handles=queued, policy_state=state or {})


def test_no_replica_and_requests_queued_asks_for_one_at_once() -> None:
    decision, _ = decide(ctx(0.0, [], target=0, queued=3.0), ZERO)
    assert (decision.desired, decision.reason) == (1, "scale-from-zero")
    # nothing queued: zero stays zero; a replica starting (target 1) is held
    assert decide(ctx(0.0, [], target=0), ZERO)[0].desired == 0
    assert decide(ctx(0.0, [], target=1, queued=3.0, current=0), ZERO)[0].desired == 1


def test_never_asks_for_zero_while_requests_wait_at_the_handles() -> None:
    state: dict = {}
    for now in range(0, 40):  # idle replica, history covers the delay: it may go ...
        decision, state = decide(ctx(float(now), [IDLE], target=1, state=state), ZERO)
    assert decision.desired == 0 and decision.reason in ("scale-down", "scale-down-held")
    # ... but not with a request queued at a handle (below the waiting threshold)
    decision, _ = decide(ctx(40.0, [IDLE], target=1, queued=0.2, state=state), ZERO)
    assert decision.desired == 1 and decision.reason.endswith("-queued")


def test_a_scale_down_serve_holds_is_asked_again_every_tick() -> None:
    """1 -> 0 waits downscale_to_zero_delay_s of consecutive asks in Serve: the policy must
    not fall back to holding 1 for another downscale_delay_s after its first ask."""
    state: dict = {}
    asks = []
    for now in range(0, 30):
        decision, state = decide(ctx(float(now), [IDLE], target=1, state=state), ZERO)
        asks.append(decision.desired)
    first = asks.index(0)
    assert all(a == 0 for a in asks[first:]), asks


def test_serve_scale_down_matches_rays_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """ServeScaleDown (the simulator's model of Serve's controller) against Ray 2.60's own
    wrapper around KVAutoscalingPolicy, tick by tick on a virtual clock: 3 idle replicas go
    to 1 after downscale_delay_s (the policy asks for 0, Serve lands on 1), then to 0
    downscale_to_zero_delay_s later (the policy asking again on every tick)."""
    import ray.serve.autoscaling_policy as ray_policy
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    clock = [0.0]
    monkeypatch.setattr(ray_policy, "time", SimpleNamespace(time=lambda: clock[0]))
    wrapped = ray_policy._apply_autoscaling_config(KVAutoscalingPolicy(**ZERO.model_dump()))
    serve_cfg = AutoscalingConfig(**serve_autoscaling_config(ZERO))
    dep = DeploymentID("LLMReplica", "app")
    model = IterserveAutoscaler(ZERO)
    idle = ReplicaLoad(0.0, 0, 0, 100, 100, 0.0, 0.0).to_autoscaling_metrics()
    ray_target, sim_target, ray_state = 3, 3, {}
    trace = []
    for tick in range(0, 400):
        now = tick * 0.1
        clock[0] = now
        reps = [ReplicaID(f"r{i}", dep) for i in range(ray_target)]
        sctx = AutoscalingContext(
            deployment_id=dep, deployment_name="LLMReplica", app_name="app",
            current_num_replicas=ray_target, target_num_replicas=ray_target,
            running_replicas=reps, total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics={k: {r: v for r in reps} for k, v in idle.items()},
            raw_metrics={k: {r: [TimeStampedValue(now, v)] for r in reps}
                         for k, v in idle.items()},
            capacity_adjusted_min_replicas=0, capacity_adjusted_max_replicas=4,
            policy_state=ray_state, last_scale_up_time=None, last_scale_down_time=None,
            current_time=now, config=serve_cfg)
        ray_target, ray_state = wrapped(sctx)
        sim_target = model.desired_replicas(ctx(now, [IDLE] * sim_target, sim_target))
        trace.append((now, ray_target, sim_target))
        assert ray_target == sim_target, trace[-5:]
    changes = [(round(t, 1), r) for (t, r, _), (_, prev, _)
               in zip(trace[1:], trace[:-1], strict=True) if r != prev]
    assert [r for _, r in changes] == [1, 0], changes
    (down_at, _), (zero_at, _) = changes
    assert down_at == pytest.approx(ZERO.downscale_delay_s, abs=0.15)
    assert zero_at - down_at == pytest.approx(ZERO.downscale_to_zero_delay_s, abs=0.15)


def test_serve_scale_down_rules() -> None:
    serve = ServeScaleDown(10.0)
    assert serve.apply(0, 3, 0.0) == 1  # never straight to zero
    assert serve.apply(0, 1, 1.0) == 1 and serve.apply(0, 1, 10.9) == 1
    assert serve.apply(0, 1, 11.0) == 0
    assert serve.apply(0, 1, 12.0) == 1  # a fresh timer ...
    assert serve.apply(1, 1, 13.0) == 1  # ... restarted by a tick asking anything else
    assert serve.apply(0, 1, 22.9) == 1 and serve.apply(4, 1, 23.0) == 4


def request(i: int, at: float) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", at, tuple(range(10, 60)), 8)


def test_simulator_starts_from_zero_with_the_policys_own_rule() -> None:
    workload = [request(i, 1.0 + 0.1 * i) for i in range(8)]
    config = ClusterSimConfig(max_num_seqs=16, max_model_len=512, num_blocks=256,
                              startup_delay_s=4.0)
    result = simulate(workload, [IterserveRouter()], 0, config, IterserveAutoscaler(ZERO))
    assert result.num_finished == 8
    first = min(r.first_token for r in result.records)
    assert first >= 1.0 + config.startup_delay_s  # the first request waited for the start
    started_at, running, starting, _ = result.replicas_over_time[0]  # the first change:
    assert (running, starting) == (0, 1) and 1.0 <= started_at <= 1.0 + 0.1  # the next tick


def test_every_baseline_scales_from_zero_and_a_policy_that_does_not_is_refused() -> None:
    workload = [request(i, 1.0 + 0.1 * i) for i in range(4)]
    config = ClusterSimConfig(max_num_seqs=16, max_model_len=512, num_blocks=256,
                              startup_delay_s=2.0)
    for scaler in (RayDefaultAutoscaler(RayAutoscalingConfig(min_replicas=0)),
                   ThresholdAutoscaler(ThresholdConfig(min_replicas=0))):
        assert simulate(workload, [IterserveRouter()], 0, config, scaler).num_finished == 4

    class StaysAtZero:
        name = "stays-at-zero"

        def desired_replicas(self, ctx: ScalingContext) -> int:
            return 0

    with pytest.raises(ValueError, match="keeps 0 replicas while"):
        simulate(workload, [IterserveRouter()], 0, config, StaysAtZero())
    with pytest.raises(ValueError, match="none only with an autoscaler"):
        simulate(workload, [IterserveRouter()], 0, config)


def test_serve_config_passes_the_zero_delay_through() -> None:
    from ray.serve.config import AutoscalingConfig

    serve_cfg = AutoscalingConfig(**serve_autoscaling_config(ZERO))
    assert serve_cfg.downscale_to_zero_delay_s == 20.0 and serve_cfg.min_replicas == 0
    assert serve_cfg.initial_replicas is None  # Serve starts a min-0 deployment with none
