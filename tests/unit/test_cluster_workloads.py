"""Cluster workloads, the trace format and `iterserve plan` on tiny cases."""

from __future__ import annotations

import bisect
import itertools
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.planner import Slo, plan
from iterserve.autoscale.sim.prompts import SyntheticPrompt
from iterserve.autoscale.sim.shapes import WORKLOADS, make
from iterserve.autoscale.sim.traces import read_trace, trace_rows, write_trace
from iterserve.loadtests.cost_model_probe import timed_runner
from iterserve.loadtests.plan import main
from iterserve.replica.outputs import ScheduledRequest, SchedulerOutput
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.sim_runner import CostModel, SimulatedRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "loadtests" / "traces" / "example_multi_turn.jsonl"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_seeded_sorted_and_sized(name: str) -> None:
    a, b = make(name, 8.0, 60.0, seed=1), make(name, 8.0, 60.0, seed=1)
    assert a == b and a != make(name, 8.0, 60.0, seed=2)
    times = [r.arrival_time for r in a]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 60.0
    assert all(0 <= t < 2**32 for r in a[:20] for t in r.prompt_token_ids)
    if name != "multi-turn":  # sessions start at rate/4 and hold several turns
        assert 0.6 * 8 * 60 < len(a) < 1.6 * 8 * 60


def test_multi_tenant_shares_contexts_and_multi_turn_grows_prefixes() -> None:
    tenants = make("multi-tenant", 10.0, 30.0)
    by_tenant: dict[str, list] = {}
    for r in tenants:
        by_tenant.setdefault(r.session_id, []).append(r)
    shared = next(rs for rs in by_tenant.values() if len(rs) > 1)
    assert tuple(shared[0].prompt_token_ids[:6000]) == tuple(shared[1].prompt_token_ids[:6000])
    turns = make("multi-turn", 10.0, 60.0)
    sessions: dict[str, list] = {}
    for r in turns:
        sessions.setdefault(r.session_id, []).append(r)
    chat = next(rs for rs in sessions.values() if len(rs) > 2)
    first, second = chat[0], chat[1]
    grown = tuple(first.prompt_token_ids) + (first.output_token_id,) * first.max_tokens
    assert tuple(second.prompt_token_ids[: len(grown)]) == grown


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_private_prompts_own_tokens_are_in_no_other_prompt(name: str) -> None:
    """SyntheticPrompt.private's promise, which the simulator's lazy hashing relies on."""
    requests = make(name, 8.0, 60.0, seed=3)
    heads: set[int] = set()
    for r in requests:
        heads.update(r.prompt_token_ids.prefix)
    owns = [range(p.unique_start, p.unique_start + p.num_unique)
            for p in (r.prompt_token_ids for r in requests)]
    private = [own for own, r in zip(owns, requests, strict=True) if r.prompt_token_ids.private]
    if name == "multi-turn":  # a turn's own tokens are the next turn's head
        assert not private and any(own[0] in heads for own in owns if len(own))
        return
    assert len(private) == len(requests)
    spans = sorted((own.start, own.stop) for own in private if len(own))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # disjoint ranges
    starts = [start for start, _ in spans]
    for token in heads:  # in no span: the span starting at or before it ends before it
        i = bisect.bisect_right(starts, token) - 1
        assert i < 0 or token >= spans[i][1]


def test_diurnal_spike_reaches_three_times_the_base() -> None:
    reqs = make("diurnal", 10.0, 600.0)
    def rate(lo: float, hi: float) -> float:
        return sum(1 for r in reqs if lo <= r.arrival_time < hi) / (hi - lo)
    assert rate(420.0, 440.0) > 2.0 * rate(300.0, 380.0)


def test_synthetic_prompt_behaves_like_the_token_list_it_stands_in_for() -> None:
    p = SyntheticPrompt((5, 6, 7), 100, 4)
    t = [5, 6, 7, 100, 101, 102, 103]
    assert len(p) == 7 and list(p) == t
    for sl in (slice(0, 2), slice(2, 5), slice(4, None), slice(None, 7), slice(0, 100),
               slice(-3, None), slice(0, 7, 2)):
        assert p[sl] == t[sl] and isinstance(p[sl], list)
    assert p[3] == 100 and p[-1] == 103
    assert p + [9, 9] == t + [9, 9]


def test_trace_round_trip_and_example(tmp_path: Path) -> None:
    requests = read_trace(EXAMPLE)
    assert len(requests) > 100
    out = tmp_path / "again.jsonl"
    write_trace(requests, out, hash_block_size=64)
    assert out.read_text() == EXAMPLE.read_text()
    again = read_trace(out)
    assert [(r.arrival_time, len(r.prompt_token_ids), r.max_tokens, r.session_id)
            for r in again] == [(r.arrival_time, len(r.prompt_token_ids), r.max_tokens,
                                 r.session_id) for r in requests]
    # the sharing structure survives: a later turn starts with its session's earlier blocks
    rows = trace_rows(requests, 64)
    by_session: dict[str, list] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row["hash_ids"])
    ids = next(v for v in by_session.values() if len(v) > 1)
    assert ids[1][: len(ids[0])] == ids[0]


def test_mooncake_and_azure_rows(tmp_path: Path) -> None:
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 600, "output_length": 20, "hash_ids": [0, 2]},
    ]))
    a, b = read_trace(mooncake, hash_block_size=512)
    assert (a.arrival_time, b.arrival_time) == (0.0, 0.5)
    assert tuple(a.prompt_token_ids[:512]) == tuple(b.prompt_token_ids[:512])
    assert a.prompt_token_ids[512:1024] != b.prompt_token_ids[512:1024]
    azure = tmp_path / "a.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.0000000,396,109\n")
    x, y = read_trace(azure)
    assert len(x.prompt_token_ids) == 374 and y.max_tokens == 109
    assert y.arrival_time == pytest.approx(3.31941)


def test_plan_finds_the_knee_on_a_tiny_case(capsys: pytest.CaptureFixture[str]) -> None:
    workload = make("steady", 24.0, 6.0)
    config = ClusterSimConfig(num_blocks=2000, max_num_seqs=64)
    best, curve = plan(workload, Slo(ttft_p99_s=0.5, itl_p99_s=0.1), config, max_replicas=16)
    assert best is not None and best > 1
    met = {p.replicas: p.meets(Slo(0.5, 0.1)) for p in curve}
    assert met[best] and not met.get(best - 1, False)
    assert main(["--trace", str(EXAMPLE), "--slo", "ttft_p99=1", "--max-replicas", "4"]) == 0
    assert "fewest replicas meeting the SLO" in capsys.readouterr().out


def test_cost_model_fit_recovers_coefficients_from_timed_steps() -> None:
    """The probe's path: steps timed around runner.execute, then CostModel.fit. The
    'measured' time here is a known cost model's, so the fit must recover it exactly."""
    truth = CostModel(a_s=0.005, b_s_per_prefill_token=2e-5, c_s_per_decode_seq=3e-5,
                      d_s_per_kv_token=4e-8)
    clock = [0.0]

    class Runner:
        def execute(self, out: SchedulerOutput) -> None:
            clock[0] += truth.step_time(*SimulatedRunner.batch_shape(out))

    engine = SimpleNamespace(runner=Runner())
    samples: list = []
    timed_runner(engine, samples, timer=lambda: clock[0])
    rng = random.Random(0)
    for _ in range(40):
        out = SchedulerOutput()
        for j in range(rng.randint(1, 8)):
            n_prompt = rng.randint(2, 500)
            request = Request(f"q{j}", [1] * n_prompt, SamplingParams(max_tokens=4), 0.0)
            if rng.random() < 0.5:  # a decode: its prompt is computed, one token sampled
                request.output_token_ids.append(1)
                out.scheduled.append(ScheduledRequest(request, n_prompt, 1, []))
            else:
                out.scheduled.append(ScheduledRequest(request, 0, n_prompt, []))
        engine.runner.execute(out)
    assert len(samples) == 40
    fitted = CostModel.fit(samples)
    for name in ("a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_kv_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
