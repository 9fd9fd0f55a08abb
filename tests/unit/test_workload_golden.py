"""Every workload generator gives, bit for bit, what it gave before the generators shared one
request type and one arrival module (issue 36).

`tests/fixtures/workload_digests.json` holds sha256 digests of each generator's requests at
the seeds, rates and sizes the tests and the committed results use, taken from the code at
56ced94 (three request types, Poisson arrivals written four times). A digest covers every
field the old type had, in its order; a changed draw, time or token fails it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from iterserve.autoscale.sim import shapes
from iterserve.autoscale.sim import workload as bucketed
from iterserve.autoscale.sim.traces import read_trace, speed_up
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies.autoscaling_step_load import autoscale_experiment
from iterserve.loadtests.studies.ray_routing import routing_experiment

ROOT = Path(__file__).resolve().parents[2]
DIGESTS: dict[str, str] = json.loads((ROOT / "tests/fixtures/workload_digests.json").read_text())
EXAMPLE_TRACE = ROOT / "loadtests/traces/example_multi_turn.jsonl"


def digest(rows: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def simulator_rows(requests: Sequence[WorkloadRequest]) -> list[list[Any]]:
    """The fields of the simulator's old `SimRequest`, in its order."""
    return [[r.request_id, repr(r.arrival_time), list(r.prompt_token_ids), r.max_tokens,
             r.session_id, r.output_token_id] for r in requests]


def ray_rows(requests: Sequence[WorkloadRequest]) -> list[list[Any]]:
    """The fields of the Ray experiments' old `RequestSpec` (send_at, is_long)."""
    return [[r.request_id, repr(r.arrival_time), list(r.prompt_token_ids), r.max_tokens,
             r.kind == "long"] for r in requests]


SHAPE_CASES = [(name, rate, duration, seed) for name in shapes.WORKLOADS
               for rate, duration in [(5.0, 60.0), (37.5, 120.0), (160.0, 30.0)]
               for seed in (0, 1, 2)]


@pytest.mark.parametrize("name, rate, duration, seed", SHAPE_CASES)
def test_the_simulator_shapes_are_unchanged(name: str, rate: float, duration: float,
                                            seed: int) -> None:
    rows = simulator_rows(shapes.make(name, rate, duration, seed))
    assert digest(rows) == DIGESTS[f"shapes/{name}/rate={rate}/duration={duration}/seed={seed}"]


BUCKET_CASES: list[tuple[int, int, dict[str, Any]]] = [
    (50, 7, {}),
    (600, 0, {"vocab_size": 4096}),
    (256, 0, {}),
    (24, 0, {"prompt_buckets": (bucketed.LengthBucket("short", 16, 96, 1.0),)}),
    (64, 3, {"output_lengths": bucketed.OutputLengths.fixed(32), "vocab_size": 49152}),
]


@pytest.mark.parametrize("n, seed, kwargs", BUCKET_CASES)
def test_the_benchmark_workload_is_unchanged(n: int, seed: int, kwargs: dict[str, Any]) -> None:
    requests = bucketed.make_workload(n, seed, **kwargs)
    rows = [[int(r.request_id), list(r.prompt_token_ids), r.max_tokens, r.kind]
            for r in requests]  # the old type: index, prompt, max_tokens, bucket
    assert digest(rows) == DIGESTS[f"buckets/n={n}/seed={seed}/{sorted(kwargs)}"]


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
@pytest.mark.parametrize("duration", [60.0, 300.0])
def test_the_routing_experiment_workload_is_unchanged(seed: int, duration: float) -> None:
    config = routing_experiment.WorkloadConfig(seed=seed, duration_s=duration)
    rows = ray_rows(routing_experiment.make_workload(config))
    assert digest(rows) == DIGESTS[f"ray_bursts/seed={seed}/duration={duration}"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_autoscaling_step_load_is_unchanged(seed: int) -> None:
    load = autoscale_experiment.StepLoad(seed=seed)
    rows = ray_rows(autoscale_experiment.make_step_workload(load))
    assert digest(rows) == DIGESTS[f"step/seed={seed}"]


@pytest.mark.parametrize("speed", [1.0, 2.5])
def test_the_example_trace_reads_as_before(speed: float) -> None:
    rows = simulator_rows(speed_up(read_trace(EXAMPLE_TRACE), speed))
    assert digest(rows) == DIGESTS[f"trace/example_multi_turn/speed={speed}"]
