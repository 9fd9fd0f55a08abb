"""The noisy neighbour in virtual time (loadtests/studies/fair_share/engine_replay.py): one
engine with the simulated runner, A at 10x B's rate above its capacity, 20 virtual seconds
(a second of CPU). The admission keeps its promise to A under either policy, and only the
fair policy keeps B's p90 TTFT near its baseline: within the issue's 1.5x at the default
step budget with each contending tenant's prompts held to its share of a step
(fair_prefill_share), which a tenant alone never feels."""

from __future__ import annotations

from iterserve.loadtests.studies.fair_share.engine_replay import replay

SECONDS = 20.0


def run(policy: str, a_rate: float, fair_prefill_share: bool = True) -> dict:
    return replay(policy, {"a": a_rate, "b": 2.0}, 2000.0, 2048, SECONDS, 0.0,
                  fair_prefill_share=fair_prefill_share)


def test_fair_keeps_b_near_its_baseline_and_every_admitted_a_request_meets_its_slo() -> None:
    baseline = run("fair", 5.0)["b"]["ttft_p90_s"]
    fair, fcfs = run("fair", 20.0), run("fcfs", 20.0)
    for result in (fair, fcfs):
        a = result["a"]
        assert a["within_a_slo"] == 1.0 and a["refused_429"] > 0
        assert a["served"] + a["refused_429"] == 20 * SECONDS  # nothing lost
        assert result["b"]["served"] == 2 * SECONDS and result["b"]["refused_429"] == 0
    assert fair["b"]["ttft_p90_s"] < 1.5 * baseline
    assert fcfs["b"]["ttft_p90_s"] > 4 * baseline  # the check can fail


def test_without_the_prefill_share_b_misses_the_floor_at_the_default_budget() -> None:
    baseline = run("fair", 5.0, fair_prefill_share=False)["b"]["ttft_p90_s"]
    assert run("fair", 20.0, fair_prefill_share=False)["b"]["ttft_p90_s"] > 1.5 * baseline


def test_a_tenant_alone_keeps_its_steps_and_throughput() -> None:
    alone = {share: replay("fair", {"a": 20.0}, 2000.0, 2048, SECONDS, 0.0,
                           fair_prefill_share=share) for share in (True, False)}
    fcfs = replay("fcfs", {"a": 20.0}, 2000.0, 2048, SECONDS, 0.0)
    assert alone[True]["steps"] == alone[False]["steps"]
    assert alone[True]["a"]["served"] == alone[False]["a"]["served"]
    assert abs(alone[True]["a"]["served"] / fcfs["a"]["served"] - 1) < 0.03
