"""The engine's CPU time per step in sim_validation's replicas: the line fit, reading the
probe's JSON, and sim_config adding it (in real seconds) to the slowed cost model, leaving
the cost model exactly as before when there is none."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.loadtests.studies.sim_validation.engine_cpu_overhead import fit_line, measure
from iterserve.loadtests.studies.sim_validation.sim_validation import MEASURED, read_engine_cpu, sim_config
from iterserve.replica.sim_runner import CostModel

META = {"time_scale": 5.0, "period_s": 0.5,
        "engine_kwargs": {"max_num_seqs": 48, "max_num_batched_tokens": 2048, "block_size": 16,
                          "max_model_len": 4096, "num_gpu_blocks_override": 640,
                          "enable_prefix_caching": True}}


def test_fit_line_recovers_a_line_and_needs_two_xs() -> None:
    assert fit_line([1, 8, 40], [0.5 + 0.03 * x for x in (1, 8, 40)]) == pytest.approx((0.5, 0.03))
    with pytest.raises(ValueError):
        fit_line([4, 4], [1.0, 2.0])


def test_sim_config_adds_the_engine_cpu_unscaled(tmp_path: Path) -> None:
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"per_step_s": 0.0003, "per_seq_s": 0.00004}))
    plain = sim_config(META, seed=1).sim.cost
    loaded = sim_config(META, seed=1, engine_cpu=read_engine_cpu(str(path))).sim.cost
    base = CostModel()
    assert plain.a_s == base.a_s * 5.0 and plain.c_s_per_decode_seq == base.c_s_per_decode_seq * 5.0
    assert loaded.a_s == base.a_s * 5.0 + 0.0003
    assert loaded.c_s_per_decode_seq == base.c_s_per_decode_seq * 5.0 + 0.00004
    assert (loaded.b_s_per_prefill_token, loaded.d_s_per_kv_token) \
        == (plain.b_s_per_prefill_token, plain.d_s_per_kv_token)
    assert read_engine_cpu(None) == (0.0, 0.0)


def test_measured_reads_the_ray_runs_own_fit_and_refuses_a_run_without_one() -> None:
    summary = {"arm": "pow2 (Ray default)",
               "engine_cpu": {"per_step_s": 0.002, "per_seq_s": 0.0001, "steps": 9e3}}
    assert read_engine_cpu(MEASURED, summary) == (0.002, 0.0001)
    with pytest.raises(SystemExit, match="did not record its engine CPU"):
        read_engine_cpu(MEASURED, {"arm": "KVAware"})


def test_the_probe_measures_a_positive_cpu_time_per_step() -> None:
    """The real engine on the simulated runner (a few hundred ms): its steps last longer
    than the cost model says, by the engine's own work."""
    result = measure([1, 4], rounds=1, steps=10)
    assert [p["running"] for p in result["points"]] == [1, 4]
    assert all(p["excess_s"] > 0 for p in result["points"])
