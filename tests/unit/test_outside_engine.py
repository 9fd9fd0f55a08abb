"""The ingress's measure of the path outside the engine (deploy/outside_engine.py), and its way
into the engine's SLO admission: a request's TenantShare carries it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from iterserve.deploy.outside_engine import SAMPLES, OutsideEngineMeter
from iterserve.deploy.tenant_requests import Tenancy
from iterserve.deploy.tenants import Caller, TenantConfig
from iterserve.replica.config import EngineConfig
from iterserve.replica.outputs import RequestOutput


def test_the_estimate_is_the_p90_of_the_recent_requests_time_outside() -> None:
    meter = OutsideEngineMeter()
    assert meter.estimate_s() == 0.0  # nothing measured: nothing reserved
    for outside_ms in range(1, 11):  # 0.001 .. 0.010 s outside the engine
        meter.record(0.5 + outside_ms / 1000, 0.5)
    assert meter.estimate_s() == pytest.approx(0.0091)
    meter.record(0.1, 0.2)  # the engine's clock ahead of the ingress's: counted as 0
    for _ in range(SAMPLES):
        meter.record(1.0, 0.75)  # the old samples leave the window
    assert meter.estimate_s() == pytest.approx(0.25)


def output(arrival: float, first_token: float | None, tokens: list[int]) -> RequestOutput:
    return RequestOutput("r", 0, tokens, "", False, None, 4, len(tokens),
                         arrival_time=arrival, first_token_time=first_token)


def test_a_request_records_its_first_token_and_the_next_request_carries_the_estimate() -> None:
    tenancy = Tenancy()
    tenant = TenantConfig("a", ttft_slo_ms=2000.0)

    async def serve_one() -> None:
        request = await tenancy.begin(Caller(tenant), None, 4, 8)
        assert request.share.ttft_outside_engine_s == 0.0
        request.started = time.perf_counter() - 0.5  # the ingress saw its first token at 0.5 s

        async def engine_stream() -> AsyncIterator[tuple[int, RequestOutput]]:
            yield 0, output(100.0, None, [])  # no token yet (a held prefill)
            yield 0, output(100.0, 100.3, [7])  # sampled 0.3 s after it reached the engine
            yield 0, output(100.0, 100.3, [8])

        async for _ in request.meter(engine_stream()):
            pass

    asyncio.run(serve_one())
    later = asyncio.run(tenancy.begin(Caller(tenant), None, 4, 8))
    assert later.share.ttft_outside_engine_s == pytest.approx(0.2, abs=0.05)
    assert later.share.ttft_slo_ms == 2000.0


@pytest.mark.parametrize("headroom", [0.0, 1.5])
def test_the_headroom_is_a_fraction_of_the_objective(headroom: float) -> None:
    with pytest.raises(ValueError, match="slo_admission_headroom"):
        EngineConfig.from_kwargs(slo_admission_headroom=headroom)
