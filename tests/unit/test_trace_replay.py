"""Replaying traces: a chat's next turn finds the conversation in the prefix cache (in the
simulator and on the real engine), an exported workload simulates as its generator does,
`tournament --trace` runs every router on a trace, and `sim_validation` replays the trace
a Ray run recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.shapes import make
from iterserve.autoscale.sim.traces import (
    read_trace,
    read_trace_turns,
    speed_up,
    trace_digest,
    write_trace,
)
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies.ray_harness import request_seed
from iterserve.loadtests.studies.ray_routing.ray_trace import FIRST_PROMPT_ID, Vocabulary, trace_specs
from iterserve.loadtests.studies.ray_routing.routing_experiment import ENGINE_KWARGS
from iterserve.loadtests.studies.router_tournament import tournament as tournament_module
from iterserve.loadtests.studies.router_tournament.tournament import main as tournament
from iterserve.loadtests.studies.router_tournament.tournament import trace_cells
from iterserve.loadtests.studies.router_tournament.tournament_cells import (
    ROUTERS,
    probe_capacity,
    probe_trace_capacity,
)
from iterserve.loadtests.studies.sim_validation.sim_validation import workload_of
from iterserve.replica.config import EngineConfig
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.sampling_params import SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "loadtests" / "traces" / "example_multi_turn.jsonl"


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_next_turn_holds_the_previous_prompt_and_answer(tmp_path: Path) -> None:
    rows = [
        {"arrival_time": 0.0, "input_tokens": 40, "output_tokens": 10, "session_id": "a",
         "hash_ids": [0, 1]},
        # a turn of session b between them: sessions do not mix
        {"arrival_time": 0.5, "input_tokens": 40, "output_tokens": 5, "session_id": "b",
         "hash_ids": [0, 7]},
        {"arrival_time": 1.0, "input_tokens": 70, "output_tokens": 8, "session_id": "a",
         "hash_ids": [0, 1, 2, 3]},
        # shorter than the previous prompt + answer: a new conversation, not a next turn
        {"arrival_time": 2.0, "input_tokens": 60, "output_tokens": 4, "session_id": "a",
         "hash_ids": [0, 1, 2]},
    ]
    first, other, second, fresh = read_trace(_write_rows(tmp_path / "t.jsonl", rows))
    head = list(first.prompt_token_ids) + [first.output_token_id] * first.max_tokens
    assert list(second.prompt_token_ids[:50]) == head
    assert len(second.prompt_token_ids) == 70
    # the next turn's own tokens and the fresh one's blocks follow the hash ids as before
    assert list(fresh.prompt_token_ids[:32]) == list(first.prompt_token_ids[:32])
    assert fresh.prompt_token_ids[32:48] != second.prompt_token_ids[32:48]
    assert list(other.prompt_token_ids[:16]) == list(first.prompt_token_ids[:16])
    assert other.prompt_token_ids[16:32] != first.prompt_token_ids[16:32]
    # a prompt a later turn holds is not private (its blocks must be findable)
    assert not first.prompt_token_ids.private
    assert second.prompt_token_ids.private and fresh.prompt_token_ids.private


def test_hash_ids_that_do_not_extend_the_previous_turn_break_the_chain(tmp_path: Path) -> None:
    rows = [
        {"arrival_time": 0.0, "input_tokens": 32, "output_tokens": 4, "session_id": "a",
         "hash_ids": [0, 1]},
        {"arrival_time": 1.0, "input_tokens": 64, "output_tokens": 4, "session_id": "a",
         "hash_ids": [0, 5, 6, 7]},
    ]
    first, second = read_trace(_write_rows(tmp_path / "t.jsonl", rows))
    assert list(second.prompt_token_ids[:16]) == list(first.prompt_token_ids[:16])
    assert second.prompt_token_ids[16:32] != first.prompt_token_ids[16:32]
    assert first.prompt_token_ids.private


def _figures(requests: list[WorkloadRequest], router: str) -> dict:
    config = ClusterSimConfig(seed=0)
    result = simulate(requests, [ROUTERS[router]() for _ in range(2)], 4, config)
    return {"prefix_hit_rate": result.prefix_hit_rate, "finished": result.num_finished,
            "preemptions": sum(r.preemptions for r in result.records),
            "ttfts": sorted(result.ttfts())}


@pytest.mark.parametrize("workload", ["multi-turn", "multi-tenant"])
def test_an_exported_workload_replays_as_its_generator(tmp_path: Path, workload: str) -> None:
    """The trace keeps what the simulation depends on: which blocks prompts share and
    which earlier answer a prompt holds. Arrival times are written to the microsecond, so
    TTFTs agree to about that."""
    generated = make(workload, 12.0, 20.0, seed=3)
    path = tmp_path / "w.jsonl"
    write_trace(generated, path)
    replayed = read_trace(path)
    for router in ("iterserve", "pow2"):
        a, b = _figures(generated, router), _figures(replayed, router)
        assert a["prefix_hit_rate"] > 0.1
        assert (a["prefix_hit_rate"], a["finished"], a["preemptions"]) == (
            b["prefix_hit_rate"], b["finished"], b["preemptions"])
        assert b["ttfts"] == pytest.approx(a["ttfts"], abs=1e-4)


def test_speed_up_divides_arrival_times_only() -> None:
    requests = read_trace(EXAMPLE)
    fast = speed_up(requests, 4.0)
    assert [r.arrival_time * 4.0 for r in fast] == pytest.approx(
        [r.arrival_time for r in requests])
    assert [r.prompt_token_ids for r in fast] == [r.prompt_token_ids for r in requests]
    with pytest.raises(ValueError):
        speed_up(requests, 0.0)


def test_tournament_replays_a_trace_at_each_size_and_speed(tmp_path: Path) -> None:
    trace = tmp_path / "chats.jsonl"
    trace.write_bytes(EXAMPLE.read_bytes())
    out = tmp_path / "out"
    args = ["--trace", str(trace), "--sizes", "2", "--trace-speeds", "1", "3", "--routers",
            "pow2", "iterserve", "--jobs", "1", "--out", str(out)]
    assert tournament(args) == 0
    store = json.loads((out / "tournament_chats.json").read_text())
    cells = list(store["cells"].values())
    assert sorted((c["speed"], c["router"]) for c in cells) == [
        (1.0, "iterserve"), (1.0, "pow2"), (3.0, "iterserve"), (3.0, "pow2")]
    for c in cells:
        assert c["kind"] == "trace" and c["finished"] == c["requests"] == 129
    slow, fast = (next(c for c in cells if c["router"] == "pow2" and c["speed"] == k)
                  for k in (1.0, 3.0))
    assert fast["rate"] == pytest.approx(3 * slow["rate"])
    assert fast["duration_s"] == pytest.approx(slow["duration_s"] / 3)
    report = (out / "tournament_chats.md").read_text()
    assert "## Trace replays" in report and "### chats x3, 2 replicas (" in report
    assert "Only 129 requests" in report and "## Routers" not in report
    # the same trace again: nothing reruns; an edited trace is another workload
    mtime = (out / "tournament_chats.json").stat().st_mtime_ns
    assert tournament(args) == 0
    assert len(json.loads((out / "tournament_chats.json").read_text())["cells"]) == 4
    trace.write_text("\n".join(EXAMPLE.read_text().splitlines()[:60]) + "\n")
    assert tournament(args) == 0
    again = json.loads((out / "tournament_chats.json").read_text())["cells"].values()
    assert len(again) == 8 and sorted(c["requests"] for c in again)[:4] == [59] * 4
    assert (out / "tournament_chats.json").stat().st_mtime_ns != mtime


def test_tournament_refuses_a_trace_with_the_matrix_options(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        tournament(["--trace", str(EXAMPLE), "--quick", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        tournament(["--trace", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        tournament(["--trace", str(EXAMPLE), "--trace-speeds", "0", "--out", str(tmp_path)])


# ------------------------------------------------------------------ the Ray experiments' replay
def _chat_trace(tmp_path: Path) -> Path:
    return _write_rows(tmp_path / "chat.jsonl", [
        {"arrival_time": 0.0, "input_tokens": 40, "output_tokens": 30, "session_id": "a"},
        {"arrival_time": 0.4, "input_tokens": 50, "output_tokens": 8},
        {"arrival_time": 3.0, "input_tokens": 90, "output_tokens": 8, "session_id": "a"},
    ])


def _generate(engine: LLMEngine, spec: WorkloadRequest) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=spec.max_tokens, seed=request_seed(spec.request_id),
                            ignore_eos=True)
    engine.add_request(spec.prompt_token_ids, params, spec.request_id)
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    return tokens, cached


def test_ray_replay_next_turn_holds_the_answer_the_engine_generates(tmp_path: Path) -> None:
    """On the real engine (simulated runner, the experiment's settings) the next turn's
    prompt holds the previous prompt and the very answer the engine sampled for it, so the
    prefix cache finds the whole conversation."""
    kwargs = {**ENGINE_KWARGS, "simulator": json.dumps({"sleep": False})}
    requests, parents = read_trace_turns(_chat_trace(tmp_path))
    assert parents == [None, None, 0]
    vocabulary = Vocabulary.of_engine(kwargs)
    specs = trace_specs(requests, parents, vocabulary, time_scale=5.0, speed=2.0)
    assert [s.arrival_time for s in specs] == pytest.approx([0.0, 1.0, 7.5])
    assert all(FIRST_PROMPT_ID <= t < vocabulary.size for s in specs
               for t in s.prompt_token_ids)
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    first, _ = _generate(engine, specs[0])
    assert len(first) == 30
    held = list(specs[0].prompt_token_ids) + first
    assert list(specs[2].prompt_token_ids[:70]) == held and len(specs[2].prompt_token_ids) == 90
    _, cached = _generate(engine, specs[2])
    assert cached == 64  # every full block of the 69 tokens the first turn computed


def test_sim_validation_replays_the_trace_the_ray_run_recorded(tmp_path: Path) -> None:
    path = _chat_trace(tmp_path)
    meta = {"time_scale": 5.0, "workload": {"trace": str(path), "hash_block_size": None,
                                            "trace_sha256": trace_digest(path), "speed": 2.0}}
    requests = workload_of(meta)
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 1.0, 7.5])
    assert [r.request_id for r in requests] == ["trace-0", "trace-1", "trace-2"]
    path.write_text(path.read_text().replace('"output_tokens": 8}', '"output_tokens": 9}'))
    with pytest.raises(SystemExit):
        workload_of(meta)


def test_trace_loads_offer_that_fraction_of_the_probed_capacity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[int] = []

    def probe(requests: list[WorkloadRequest], max_model_len: int | None = None) -> float:
        probed.append(len(requests))
        return 3.0

    monkeypatch.setattr(tournament_module, "probe_trace_capacity", probe)
    capacity: dict[str, float] = {}
    requests = read_trace(EXAMPLE)
    trace_rate = len(requests) / max(r.arrival_time for r in requests)
    cells = trace_cells(EXAMPLE, [2, 4], ["pow2"], 0, speeds=[1.0], loads=[0.5, 0.8],
                        capacity=capacity)
    assert probed == [len(requests)] and list(capacity.values()) == [3.0]
    by = {(c["replicas"], c["load"]): c for c in cells}
    assert by[(2, None)]["speed"] == 1.0 and by[(2, None)]["workload"] == "example_multi_turn x1"
    for n, load in ((2, 0.5), (4, 0.5), (4, 0.8)):
        assert by[(n, load)]["rate"] == pytest.approx(load * 3.0 * n)
        assert by[(n, load)]["speed"] == pytest.approx(load * 3.0 * n / trace_rate)
        assert by[(n, load)]["workload"] == "example_multi_turn"
    trace_cells(EXAMPLE, [8], ["pow2"], 0, loads=[0.5], capacity=capacity)
    assert len(probed) == 1  # the store's capacity is reused
    with pytest.raises(ValueError, match="max_model_len"):
        trace_cells(EXAMPLE, [2], ["pow2"], 0, speeds=[1.0], max_model_len=512)


def test_trace_probe_agrees_with_the_generator_probe(tmp_path: Path) -> None:
    """The same procedure on a recorded run of a generator finds the generator's capacity
    (another draw of it, sped up rather than regenerated: within 10 %)."""
    path = tmp_path / "steady.jsonl"
    write_trace(make("steady", 30.0, 400.0, seed=5), path)
    traced = probe_trace_capacity(read_trace(path), duration_s=30.0, start_rate=16.0)
    assert traced == pytest.approx(probe_capacity("steady"), rel=0.10)
    # the 40 s example, sped up to the first probe rate, is over in 16 s
    with pytest.raises(ValueError, match="too short"):
        probe_trace_capacity(read_trace(EXAMPLE))


def test_session_ids_as_numbers_and_answers_of_no_tokens(tmp_path: Path) -> None:
    rows = [
        {"arrival_time": 0.0, "input_tokens": 32, "output_tokens": 0, "session_id": 0},
        # as long as the previous prompt: its one replayed answer token does not fit
        {"arrival_time": 1.0, "input_tokens": 32, "output_tokens": 4, "session_id": 0},
        {"arrival_time": 2.0, "input_tokens": 40, "output_tokens": 4, "session_id": 0},
    ]
    requests, parents = read_trace_turns(_write_rows(tmp_path / "t.jsonl", rows))
    assert parents == [None, None, 1] and requests[0].session_id == "0"
    assert requests[0].max_tokens == 1 and len(requests[1].prompt_token_ids) == 32
