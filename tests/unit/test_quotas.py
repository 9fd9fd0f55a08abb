"""Tenant quotas: the ledger's buckets and leases on a driven clock, and over HTTP the 429
(OpenAI's body, Retry-After) and the x-ratelimit-* headers counting down.

The HTTP test runs the real `create_app` over the real tiny-model engine in this process,
with the ledger in this process (`LocalQuotas`); the cluster-wide ledger (a named Ray actor
shared by two ingress replicas) is tests/integration/test_tenant_quotas_ray.py's.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from iterserve.dashboards.metrics import (
    TENANT_GENERATION_TOKENS,
    TENANT_PROMPT_TOKENS,
    TENANT_REQUESTS,
    TENANT_TIME_TO_FIRST_TOKEN,
    MetricSpec,
    metric_name,
)
from iterserve.dashboards.tenant_metrics import TenantMetrics
from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.quota_ledger import QuotaLedger
from iterserve.deploy.quotas import LocalQuotas, duration_text
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.deploy.tenant_file import parse_keys_file
from iterserve.deploy.tenant_requests import Tenancy
from iterserve.deploy.tenants import TenantQuota
from iterserve.replica import AsyncLLMEngine, EngineConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tokens_per_minute_is_a_bucket_of_one_minute_refilled_continuously() -> None:
    clock = Clock()
    ledger = QuotaLedger(clock)
    quota = TenantQuota(tokens_per_minute=600)  # 10 tokens a second
    first = ledger.admit("t", quota, 500)
    assert first.admitted and first.tokens is not None and first.tokens.remaining == 100
    assert first.tokens.reset_s == pytest.approx(50.0)  # 500 tokens at 10/s
    refused = ledger.admit("t", quota, 200)
    assert not refused.admitted and refused.refusal == "tokens"
    assert refused.retry_after_s == pytest.approx(10.0)  # 100 more tokens at 10/s
    clock.now += 10
    assert ledger.admit("t", quota, 200).admitted
    assert ledger.admit("other", quota, 600).admitted  # each tenant its own bucket


def test_a_release_refunds_what_the_request_did_not_use() -> None:
    clock = Clock()
    ledger = QuotaLedger(clock)
    quota = TenantQuota(tokens_per_minute=100)
    lease = ledger.admit("t", quota, 100)
    assert not ledger.admit("t", quota, 50).admitted
    assert lease.lease_id is not None
    ledger.release(lease.lease_id, 30)  # used 30 of the 100 charged
    again = ledger.admit("t", quota, 70)
    assert again.admitted and again.tokens is not None and again.tokens.remaining == 0
    ledger.release(lease.lease_id, 0)  # a second release changes nothing
    assert not ledger.admit("t", quota, 1).admitted


def test_a_request_larger_than_a_minutes_quota_is_refused_without_a_wait() -> None:
    refused = QuotaLedger(Clock()).admit("t", TenantQuota(tokens_per_minute=100), 101)
    assert not refused.admitted and refused.retry_after_s is None


def test_requests_per_minute_and_concurrent_requests() -> None:
    clock = Clock()
    ledger = QuotaLedger(clock, lease_ttl_s=600)
    quota = TenantQuota(requests_per_minute=2, max_concurrent_requests=1)
    first = ledger.admit("t", quota, 1)
    assert first.admitted and first.requests is not None and first.requests.remaining == 1
    busy = ledger.admit("t", quota, 1)
    assert busy.refusal == "concurrent" and busy.retry_after_s == 1.0
    assert first.lease_id is not None
    ledger.release(first.lease_id, 1)
    assert ledger.admit("t", quota, 1).admitted  # the second of the minute's two requests
    both = ledger.admit("t", quota, 1)  # one open and none left this minute: the longer wait
    assert both.refusal == "requests" and both.retry_after_s == pytest.approx(30.0)
    clock.now += 600  # its ingress never released it: dropped after its time to live
    assert ledger.admit("t", quota, 1).admitted


def test_duration_text_is_openais() -> None:
    assert [duration_text(s) for s in (0.0172, 1, 2.5, 360, 61.25)] == [
        "18ms", "1s", "2.5s", "6m0s", "1m1.25s"]


# ------------------------------------------------------------------------------ over HTTP

KEYS = "tenant small tokens_per_minute=300 requests_per_minute=5\nsk-small small\nsk-free\n"


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig.from_kwargs(model="iterserve-tiny", device="cpu", max_model_len=128,
                                      num_gpu_blocks_override=64, max_num_seqs=4)
    engine = AsyncLLMEngine(config)
    yield engine
    engine.shutdown()


def test_over_quota_is_a_429_with_retry_after_and_the_headers_count_down(engine) -> None:
    parsed = parse_keys_file(KEYS)
    settings = IngressSettings(api_keys=parsed.keys, tenants=parsed.tenants)
    clock = Clock()
    registry = CollectorRegistry()
    metrics = TenantMetrics("tiny", registry=registry, backend="prometheus")
    app = create_app(LocalEngineClient(engine), settings,
                     tenancy=Tenancy(quotas=LocalQuotas(QuotaLedger(clock)), metrics=metrics))
    body = {"prompt": list(range(5, 25)), "max_tokens": 40, "ignore_eos": True}  # 60 tokens
    with TestClient(app, headers={"Authorization": "Bearer sk-small"}) as http:
        remaining = []
        for _ in range(5):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.headers["x-ratelimit-limit-tokens"] == "300"
            assert response.headers["x-ratelimit-limit-requests"] == "5"
            remaining.append((int(response.headers["x-ratelimit-remaining-requests"]),
                              int(response.headers["x-ratelimit-remaining-tokens"])))
        assert remaining == [(4, 240), (3, 180), (2, 120), (1, 60), (0, 0)]
        assert response.headers["x-ratelimit-reset-tokens"] == "1m0s"
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] in ("tokens", "requests")
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        # A tenant without quota: no rate-limit headers, never a 429 of ours.
        free = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-free"})
        assert free.status_code == 200 and "x-ratelimit-limit-tokens" not in free.headers
        clock.now += 12  # 60 tokens and one request refilled
        stream = http.post("/v1/completions", json={**body, "stream": True})
        assert stream.status_code == 200 and stream.headers["x-ratelimit-remaining-tokens"] == "0"
        assert stream.text.rstrip().endswith("data: [DONE]")

    def sample(spec: MetricSpec, **labels: str) -> float | None:
        return registry.get_sample_value(metric_name(spec),
                                         {"model_name": "tiny", "tenant": "small", **labels})

    assert sample(TENANT_REQUESTS, outcome="admitted") == 6.0  # five, then the stream
    assert sample(TENANT_REQUESTS, outcome="rate_limited") == 1.0
    assert sample(TENANT_PROMPT_TOKENS) == 6 * 20 and sample(TENANT_GENERATION_TOKENS) == 6 * 40
    ttfts = registry.get_sample_value(metric_name(TENANT_TIME_TO_FIRST_TOKEN, "_count"),
                                      {"model_name": "tiny", "tenant": "small"})
    assert ttfts == 6.0


def test_a_ledger_that_does_not_answer_is_a_503_not_an_uncounted_request(monkeypatch) -> None:
    """RayQuotas over a stand-in actor handle whose answer never comes (a real Ray actor
    that hangs cannot be made here without Ray; the Serve test covers the real one)."""
    import asyncio

    from iterserve.deploy import quotas
    from iterserve.deploy.errors import OpenAIHTTPError
    from iterserve.deploy.tenants import TenantConfig

    class Hanging:
        class admit:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote(*_: object) -> object:
                return asyncio.sleep(60)

    monkeypatch.setattr(quotas, "LEDGER_TIMEOUT_S", 0.05)
    gate = quotas.RayQuotas("unused")
    gate._actor = Hanging()
    tenant = TenantConfig("t", quota=TenantQuota(tokens_per_minute=10))
    with pytest.raises(OpenAIHTTPError) as error:
        asyncio.run(gate.admit(tenant, 1))
    assert error.value.status_code == 503 and error.value.headers["Retry-After"] == "1"
