"""KVAutoscalingPolicy in a real local Ray Serve: scale up under load, back down after it,
with simulated replicas (deploy's LLMReplica, runner=simulated) and no failed request."""

from __future__ import annotations

import asyncio
import json

import pytest

ray = pytest.importorskip("ray")

from iterserve.autoscale.autoscaling_policy import autoscaling_env_vars  # noqa: E402
from iterserve.autoscale.config import AutoscaleConfig  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

SCALING = AutoscaleConfig(
    min_replicas=1, max_replicas=3, target_waiting_per_replica=2.0, upscale_delay_s=1.0,
    downscale_delay_s=3.0, look_back_period_s=1.5, metrics_push_interval_s=0.5,
)


@pytest.fixture(scope="module")
def ray_serve():
    pytest.importorskip("iterserve.deploy.llm_replica")
    from ray import serve

    from iterserve.loadtests.studies.ray_harness import start_ray

    start_ray(autoscaling_env_vars(SCALING), num_cpus=8)
    yield
    serve.shutdown()
    ray.shutdown()


def test_scale_up_then_down_without_failed_requests(ray_serve):
    from iterserve.loadtests.studies.autoscaling_step_load.autoscale_experiment import (
        ENGINE_KWARGS,
        StepLoad,
        run,
    )

    load = StepLoad(seed=1, low_rate=0.3, high_rate=4.0, low1_s=4.0, high_s=20.0,
                    low2_s=25.0)
    engine = {**ENGINE_KWARGS, "simulator": json.dumps({"time_scale": 5.0})}
    result = asyncio.run(run(load, SCALING, engine, 5.0, app_name="as_test"))
    s = result["summary"]
    assert s["failed"] == 0, result["errors"]
    assert s["peak_replicas"] >= 2, result["counts"]
    assert s["time_to_first_new_replica_running_s"] is not None
    # back to min_replicas once the load drops (drained, nothing lost)
    assert s["time_from_step_down_to_min_s"] is not None, result["counts"][-5:]
