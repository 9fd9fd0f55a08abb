"""SLO-aware admission (replica/slo_admission.py): the prediction over plain requests, and the
engine (simulated runner, real scheduler and prefill-rate meter) refusing at once a request
predicted to miss its tenant's ttft_slo_ms, never one already admitted."""

from __future__ import annotations

import itertools
import time

import pytest

from iterserve.deploy.errors import engine_error_info
from iterserve.replica.config import EngineConfig
from iterserve.replica.errors import SLOUnreachableError
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.request import Request, TenantShare
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.slo_admission import (
    ACTIVE_WINDOW_S,
    ActiveTenants,
    DrainRate,
    check_ttft_slo,
    predicted_ttft_s,
)

_ids = itertools.count()
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def queued(tenant: str, tokens: int, priority: int = 0, weight: float = 1.0) -> Request:
    return Request(f"s{next(_ids)}", [1] * tokens, PARAMS, 0.0, priority, tenant=tenant,
                   tenant_weight=weight)


RATE = DrainRate(1000.0, 0.0)  # 1,000 prompt tokens a second, steps of no length


def test_fcfs_counts_its_band_and_the_bands_ahead_not_those_behind() -> None:
    admitted = [queued("a", 300), queued("b", 100, priority=-1), queued("c", 500, priority=1)]
    assert predicted_ttft_s(admitted, 100, 0, TenantShare("b"), False, RATE, {}) == 0.5


def test_fair_drains_its_own_tenants_work_at_its_weighted_share() -> None:
    admitted = [queued("heavy", 5000), queued("light", 100)]
    light = TenantShare("light", 1.0)
    # light's 100 queued + its 100 at half the rate (heavy is backlogged), not behind 5000
    assert predicted_ttft_s(admitted, 100, 0, light, True, RATE, {}) == 0.4
    assert predicted_ttft_s(admitted, 100, 0, TenantShare("light", 2.0), True, RATE, {}) == 0.3
    assert predicted_ttft_s(admitted, 100, 0, light, False, RATE, {}) == 5.2
    assert predicted_ttft_s(admitted, 100, 0, light, True, DrainRate(0.0, 0.0), {}) is None


def test_a_tenant_admitted_lately_takes_its_share_though_nothing_of_it_is_queued() -> None:
    """The noisy neighbour's light tenant: nothing queued now, but its next request goes
    ahead of the heavy tenant's queue, so the heavy tenant's own work drains at half rate."""
    admitted = [queued("heavy", 900)]
    heavy = TenantShare("heavy", 1.0)
    assert predicted_ttft_s(admitted, 100, 0, heavy, True, RATE, {}) == 1.0
    assert predicted_ttft_s(admitted, 100, 0, heavy, True, RATE, {"light": 1.0}) == 2.0
    assert predicted_ttft_s(admitted, 100, 0, heavy, True, RATE, {"light": 3.0}) == 4.0
    assert predicted_ttft_s(admitted, 100, 0, heavy, False, RATE, {"light": 1.0}) == 1.0


def test_the_prediction_adds_a_step_and_the_path_outside_the_engine() -> None:
    outside = TenantShare("a", 1.0, 2000.0, ttft_outside_engine_s=0.15)
    got = predicted_ttft_s([queued("a", 400)], 100, 0, outside, True, DrainRate(1000.0, 0.25),
                           {})
    assert got == pytest.approx(0.15 + 0.25 + 0.5)


def test_admission_leaves_the_headroom_below_the_objective() -> None:
    tenant = TenantShare("a", 1.0, 1000.0)
    admitted = [queued("a", 800)]  # predicted 0.9 s of a 1 s objective
    check_ttft_slo(admitted, 100, 0, tenant, True, RATE, {}, headroom=1.0)
    with pytest.raises(SLOUnreachableError) as refused:
        check_ttft_slo(admitted, 100, 0, tenant, True, RATE, {}, headroom=0.8)
    assert refused.value.retry_after_s == pytest.approx(0.1)


def test_active_tenants_forget_a_tenant_idle_past_the_window() -> None:
    active = ActiveTenants()
    active.admitted(0, TenantShare("b", 2.0), now=10.0)
    active.admitted(1, TenantShare("c"), now=10.0)
    assert active.of_band(0, now=10.0 + ACTIVE_WINDOW_S) == {"b": 2.0}
    assert active.of_band(0, now=10.1 + ACTIVE_WINDOW_S) == {}
    assert active.of_band(1, now=10.0) == {"c": 1.0}


def saturated_engine(policy: str) -> tuple[LLMEngine, list[str]]:
    engine = LLMEngine(EngineConfig.from_kwargs(
        runner="simulated", max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=256,
        scheduler_policy=policy))
    ids = [engine.add_request([5] * 200, PARAMS, tenant=TenantShare("a", 1.0, 50.0))
           for _ in range(20)]
    for _ in range(5):
        engine.step()  # the prefill rate is measured; ~3000 prompt tokens still queued
    return engine, ids


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_request_predicted_to_miss_its_slo_is_refused_and_the_admitted_all_finish(
        policy: str) -> None:
    engine, admitted = saturated_engine(policy)
    with pytest.raises(SLOUnreachableError) as refused:
        engine.add_request([5] * 200, PARAMS, tenant=TenantShare("a", 1.0, 50.0))
    info = engine_error_info(refused.value)
    assert info is not None and info.status_code == 429 and info.err_type == "rate_limit_error"
    assert info.to_http().headers["Retry-After"] == "1"
    patient = engine.add_request([5] * 200, PARAMS, tenant=TenantShare("b", 1.0, 60_000.0))
    no_slo = engine.add_request([5] * 200, PARAMS, tenant=TenantShare("c"))
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == {*admitted, patient, no_slo}  # nothing admitted was dropped


def test_the_drain_rate_counts_the_time_between_steps_and_the_step_rate_does_not() -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(
        runner="simulated", max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=256))
    for _ in range(20):
        engine.add_request([5] * 200, PARAMS)
    for _ in range(12):
        engine.step()
        time.sleep(0.03)  # the engine loop busy elsewhere (another process on its core)
    now = engine.clock()
    step_rate, drain_rate = engine.prefill_rate.rate(now), engine.prefill_drain_rate.rate(now)
    assert 0 < drain_rate < 0.8 * step_rate


def test_an_idle_engine_admits_whatever_the_slo() -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(runner="simulated", max_model_len=512))
    engine.add_request([5] * 400, PARAMS, tenant=TenantShare("a", 1.0, 0.001))
    assert engine.has_unfinished_requests()
