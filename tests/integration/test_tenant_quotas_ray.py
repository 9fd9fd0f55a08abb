"""Tenant quotas on Ray Serve with TWO ingress replicas: one tenant's tokens-per-minute quota
is counted once for the cluster (the ledger is a named Ray actor both ingresses ask), so a
burst gets the quota's worth of requests, not twice it; every refusal is OpenAI's 429 with
Retry-After; and a second tenant's identical prompt finds nothing cached while its own
repeat does. Real HTTP through the Serve proxy, the real engine with the tiny model (CPU).

The quota is sized so the burst's admissions (all before any generation) happen within a
second, while the bucket refills 1000/60 tokens a second: well under one more request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = list(range(100, 190))  # 90 tokens
MAX_TOKENS = 10  # charged 100 tokens a request (ignore_eos: it uses all of them)
TPM = 1000  # ten requests' worth
KEYS = f"""\
tenant metered tokens_per_minute={TPM} requests_per_minute=1000
tenant other
tenant third
sk-metered metered
sk-other other
sk-third third
"""


@pytest.fixture(scope="module")
def base_url(integration: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(KEYS)
    app_args = {
        "engine_kwargs": {**integration.SMALL_ENGINE, "max_num_seqs": 16},
        "api_key_file": str(keys),
        "api_keys": ["sk-probe"],  # the default tenant's: serve_app's readiness probe uses it
        "num_ingress_replicas": 2,
        "num_gpus_per_replica": 0,
    }
    with integration.serve_app(app_args) as url:
        yield url


async def burst(base_url: str, key: str, count: int) -> list[httpx.Response]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=body,
                                                       headers=headers)
                                           for _ in range(count))))


def test_two_ingress_replicas_hold_a_tenant_to_one_quota(base_url: str) -> None:
    import ray

    from iterserve.deploy.quotas import quota_actor_name

    responses = asyncio.run(burst(base_url, "sk-metered", 30))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    # Ten requests' worth (plus at most one more refilled during the burst); two ledgers,
    # one per ingress, would have admitted about twenty.
    assert 10 <= len(admitted) <= 11, [r.status_code for r in responses]
    for response in refused:
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(response.headers["Retry-After"]) >= 1
        assert response.headers["x-ratelimit-limit-tokens"] == str(TPM)
    remaining = sorted(int(r.headers["x-ratelimit-remaining-tokens"]) for r in admitted)
    assert remaining[0] < 100 and remaining[-1] >= TPM - 200  # counted down across both
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in admitted)
    ray.get_actor(quota_actor_name("iterserve"), namespace="serve")  # the one ledger
    # Each ingress counts its own requests per tenant, and /metrics answers from whichever
    # ingress the proxy picks (one of them may have refused none of the burst): scrape until
    # both ingresses' series have been seen, as Prometheus would over its targets.
    scrapes = [httpx.get(f"{base_url}/metrics", timeout=30).text for _ in range(24)]
    assert all("iterserve:tenant_requests_total" in text for text in scrapes)
    seen = "".join(scrapes)
    assert 'tenant="metered"' in seen
    assert 'outcome="rate_limited"' in seen


def test_tenants_do_not_share_cached_prompts_over_serve(base_url: str) -> None:
    def cached(key: str) -> int:
        response = httpx.post(f"{base_url}/v1/completions", timeout=120,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": [p + 500 for p in PROMPT], "max_tokens": 1})
        assert response.status_code == 200, response.text
        assert "x-ratelimit-limit-tokens" not in response.headers  # no quota: no headers
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("sk-other") == 0
    assert cached("sk-other") == 80  # its own repeat: five full blocks
    assert cached("sk-third") == 0  # another tenant's identical prompt: nothing cached
