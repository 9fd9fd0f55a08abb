"""SimulatedRunner: cost model, KV budget, deterministic tokens, cheap CPU."""

from __future__ import annotations

import json
import time

import pytest

from iterserve.replica.config import EngineConfig
from iterserve.replica.outputs import ScheduledRequest, SchedulerOutput
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.sim_runner import (
    CostModel,
    SimulatedRunner,
    SimulatorConfig,
)

VOCAB = 1000


class FakeSleep:
    def __init__(self):
        self.calls: list[float] = []

    def __call__(self, s: float) -> None:
        self.calls.append(s)


def runner(sim=None, sleep=None, **engine_kwargs):
    cfg = EngineConfig.from_kwargs(runner="simulated", **engine_kwargs)
    return SimulatedRunner(cfg, VOCAB, sim_config=sim or SimulatorConfig(),
                           sleep_fn=sleep or FakeSleep(), clock=lambda: 0.0)


def req(rid="r", prompt=None, seed=None, temperature=1.0, eos=frozenset({2}), **kw):
    return Request(rid, prompt or list(range(10, 42)), SamplingParams(
        seed=seed, temperature=temperature, max_tokens=1000, **kw), arrival_time=0.0,
        eos_token_ids=eos)


def prefill(r):
    return ScheduledRequest(r, 0, r.num_tokens, [0])


def decode(r):
    return ScheduledRequest(r, r.num_tokens - 1, 1, [0])


def generate(run, r, n):
    out = run.execute(SchedulerOutput([prefill(r)]))
    r.output_token_ids.append(out.sampled_token_ids[r.request_id])
    for _ in range(n - 1):
        out = run.execute(SchedulerOutput([decode(r)]))
        r.output_token_ids.append(out.sampled_token_ids[r.request_id])
    return list(r.output_token_ids)


def test_constructor_matches_the_engine_contract():
    cfg = EngineConfig.from_kwargs(runner="simulated")
    r = SimulatedRunner(cfg, 128256)
    assert r.vocab_size == 128256 and r.num_kv_blocks() > 0


def test_kv_blocks_from_simulated_memory_budget():
    r = runner(block_size=16, gpu_memory_utilization=0.9)
    budget = 80e9 * 0.9 - 16e9 - 2e9
    assert r.kv_bytes_per_block == 131072 * 16
    assert r.num_kv_blocks() == int(budget // (131072 * 16))
    assert runner(num_gpu_blocks_override=77).num_kv_blocks() == 77
    small = SimulatorConfig(gpu_memory_bytes=10 * 10**9)
    with pytest.raises(ValueError):
        runner(sim=small).num_kv_blocks()


def test_cost_model_formula_and_sleep():
    cost = CostModel(a_s=0.01, b_s_per_prefill_token=1e-4, c_s_per_decode_seq=1e-3,
                     d_s_per_kv_token=1e-6)
    sleep = FakeSleep()
    run = runner(sim=SimulatorConfig(cost=cost, time_scale=2.0), sleep=sleep)
    a, b = req("a"), req("b", prompt=list(range(100)))
    a.output_token_ids = [5, 6]
    batch = SchedulerOutput([decode(a), ScheduledRequest(b, 0, 64, [0])])  # chunk of 64
    assert run.batch_shape(batch) == (64, 1, 34 + 64)
    expected = 0.01 + 64e-4 + 1e-3 + 98e-6
    assert run.step_time(batch) == pytest.approx(expected)
    out = run.execute(batch)
    assert set(out.sampled_token_ids) == {"a"}  # b's chunk stops short: no sample
    assert sleep.calls == [pytest.approx(2 * expected)]
    assert run.execute(SchedulerOutput()).sampled_token_ids == {}
    assert len(sleep.calls) == 1


def test_default_coefficients_are_plausible_for_8b_on_h100():
    cost = CostModel()
    # one decode at short context: ~6.5 ms TPOT
    assert 5e-3 < cost.step_time(0, 1, 512) < 8e-3
    # 2048-token prefill: ~60 ms -> ~30k+ tok/s
    assert 0.05 < cost.step_time(2048, 0, 2048) < 0.1
    # batch 64 at 1k context: a few thousand tokens/s
    assert 3000 < 64 / cost.step_time(0, 64, 64 * 1024) < 8000


def test_tokens_are_deterministic_and_position_keyed():
    a = generate(runner(), req("x", seed=7), 20)
    b = generate(runner(), req("y", seed=7), 20)
    c = generate(runner(), req("x", seed=8), 20)
    assert a == b and a != c
    assert all(0 <= t < VOCAB for t in a)
    # unseeded: keyed by request id
    assert generate(runner(), req("p"), 10) == generate(runner(), req("p"), 10)
    assert generate(runner(), req("p"), 10) != generate(runner(), req("q"), 10)
    # greedy: keyed by the prompt, like real greedy decoding
    g1 = generate(runner(), req("g1", temperature=0.0), 10)
    g2 = generate(runner(), req("g2", temperature=0.0), 10)
    assert g1 == g2


def test_preemption_recompute_gives_the_same_tokens():
    run = runner()
    r = req("pre", seed=3)
    first = generate(run, r, 5)
    # preempted: recompute the whole sequence, then keep decoding
    r.num_computed_tokens = 0
    out = run.execute(SchedulerOutput([ScheduledRequest(r, 0, r.num_tokens, [0])]))
    r.output_token_ids.append(out.sampled_token_ids["pre"])
    ref = generate(runner(), req("pre", seed=3), 6)
    assert first + [r.output_token_ids[-1]] == ref


def test_never_emits_eos_or_stop_tokens_unless_configured():
    tiny = 4
    cfg = EngineConfig.from_kwargs(runner="simulated")
    run = SimulatedRunner(cfg, tiny, SimulatorConfig(sleep=False))
    r = req("e", eos=frozenset({0}), stop_token_ids=(1,))
    toks = generate(run, r, 200)
    assert set(toks) <= {2, 3}
    run = SimulatedRunner(cfg, VOCAB, SimulatorConfig(sleep=False, eos_probability=0.5))
    toks = generate(run, req("e2", eos=frozenset({2})), 50)
    assert 2 in toks
    run.release("e2")
    assert "e2" not in run._seeds


def test_measured_coefficients_replace_defaults(tmp_path):
    truth = CostModel(0.004, 2e-5, 3e-5, 4e-8)
    samples = [(p, s, k, truth.step_time(p, s, k))
               for p, s, k in [(0, 1, 100), (512, 0, 512), (0, 64, 64000), (128, 32, 9000),
                               (2048, 8, 20000), (0, 128, 200000)]]
    fitted = CostModel.fit(samples)
    for name in ("a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_kv_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"a_s": 0.001, "time_scale": 3.0}))
    sim = SimulatorConfig.from_spec(str(path))
    assert sim.cost.a_s == 0.001 and sim.time_scale == 3.0
    assert SimulatorConfig.from_spec(None) == SimulatorConfig()
    inline = SimulatorConfig.from_spec('{"cost": {"a_s": 0.002}}')
    assert inline.cost.a_s == 0.002
    h200 = SimulatorConfig.from_spec('{"preset": "h200", "time_scale": 2}')
    assert h200.gpu_memory_bytes == 141 * 10**9 and h200.time_scale == 2.0
    assert h200.cost.step_time(0, 1, 512) < CostModel().step_time(0, 1, 512)
    with pytest.raises(ValueError):
        SimulatorConfig.from_mapping({"preset": "a100"})
    with pytest.raises(ValueError):
        SimulatorConfig.from_mapping({"nope": 1})
    with pytest.raises(ValueError):
        CostModel(a_s=-1)


def test_execute_is_cheap_in_cpu():
    cfg = EngineConfig.from_kwargs(runner="simulated")
    run = SimulatedRunner(cfg, 128256, SimulatorConfig(sleep=False))
    reqs = [req(f"r{i}", seed=i) for i in range(256)]
    for r in reqs:
        r.output_token_ids = [5] * 100
    batch = SchedulerOutput([decode(r) for r in reqs])
    t0 = time.process_time()  # this process's CPU time: other work on the box does not count
    for _ in range(20):
        run.execute(batch)
    per_step = (time.process_time() - t0) / 20
    assert per_step < 5e-3  # 256 sequences: well under the ~20 ms it models
