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
from iterserve.replica.slo_admission import predicted_ttft_s

_ids = itertools.count()
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def queued(tenant: str, tokens: int, priority: int = 0, weight: float = 1.0) -> Request:
    return Request(f"s{next(_ids)}", [1] * tokens, PARAMS, 0.0, priority, tenant=tenant,
                   tenant_weight=weight)


def test_fcfs_counts_its_band_and_the_bands_ahead_not_those_behind() -> None:
    admitted = [queued("a", 300), queued("b", 100, priority=-1), queued("c", 500, priority=1)]
    assert predicted_ttft_s(admitted, 100, 0, TenantShare("b"), False, 1000.0) == 0.5


def test_fair_counts_a_heavy_tenants_backlog_only_up_to_the_weighted_share() -> None:
    admitted = [queued("heavy", 5000), queued("light", 100)]
    light = TenantShare("light", 1.0)
    # light's 100 queued + its 100: heavy is served as much meanwhile, not all 5000
    assert predicted_ttft_s(admitted, 100, 0, light, True, 1000.0) == 0.4
    assert predicted_ttft_s(admitted, 100, 0, TenantShare("light", 2.0), True, 1000.0) == 0.3
    assert predicted_ttft_s(admitted, 100, 0, light, False, 1000.0) == 5.2
    assert predicted_ttft_s(admitted, 100, 0, light, True, 0.0) is None  # no rate yet


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
