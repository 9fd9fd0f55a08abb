"""Where the ingress asks for quota, and how the answer reads over HTTP.

`RayQuotas` keeps the one `QuotaLedger` of an application in a named Ray actor (created by
the first ingress replica that asks, found by the others: the pattern of the router's sync
hub), so every ingress replica draws on the same buckets. It is detached, so an ingress
replica that stops does not take the tenants' counts with it; a call that finds the actor
gone asks for it once more. `LocalQuotas` holds a ledger in this process (the in-process
server, the tests). Only tenants with a quota pay the actor's round trip.

Over quota: a 429 with OpenAI's body (`code: rate_limit_exceeded`, `type` tokens or
requests) and `Retry-After`; a request that could never fit (more tokens than a minute's
quota) gets the 429 without it, as OpenAI's "Request too large". A tenant with quotas gets
OpenAI's `x-ratelimit-limit-*`, `x-ratelimit-remaining-*` and `x-ratelimit-reset-*` headers
(requests: requests per minute; tokens: tokens per minute) on every answer, 429s included.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Protocol

from iterserve.deploy.errors import OpenAIHTTPError
from iterserve.deploy.quota_ledger import Admission, Limit, QuotaLedger
from iterserve.deploy.tenants import TenantConfig

logger = logging.getLogger(__name__)

QUOTA_ACTOR_ERRORS = ("ActorDiedError", "RayActorError", "ActorUnavailableError")
# How long a request waits for the ledger's answer: past it, a 503 (a tenant with quotas is
# never served uncounted), as when the actor cannot be reached at all.
LEDGER_TIMEOUT_S = 10.0


class QuotaGate(Protocol):
    async def admit(self, tenant: TenantConfig, tokens: int) -> Admission: ...

    def release(self, lease_id: int, used_tokens: int) -> None: ...


class LocalQuotas:
    """A ledger in this process: one ingress, or a test."""

    def __init__(self, ledger: QuotaLedger | None = None) -> None:
        self.ledger = ledger or QuotaLedger()

    async def admit(self, tenant: TenantConfig, tokens: int) -> Admission:
        return self.ledger.admit(tenant.name, tenant.quota, tokens)

    def release(self, lease_id: int, used_tokens: int) -> None:
        self.ledger.release(lease_id, used_tokens)


def quota_actor_name(app_name: str) -> str:
    return f"iterserve-tenant-quotas:{app_name}"


class RayQuotas:
    """The application's ledger in a named, detached Ray actor (one count for the cluster)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._actor: Any = None
        self._releases: set[asyncio.Task[None]] = set()

    def _handle(self) -> Any:  # noqa: ANN401 - a Ray actor handle
        if self._actor is None:
            import ray

            actor_class = ray.remote(num_cpus=0, max_concurrency=1)(QuotaLedger)
            self._actor = actor_class.options(name=self._name, namespace="serve",
                                              lifetime="detached",
                                              get_if_exists=True).remote()
        return self._actor

    async def admit(self, tenant: TenantConfig, tokens: int) -> Admission:
        """The ledger's answer; the actor found again once if it is gone; a 503 when it
        cannot answer within LEDGER_TIMEOUT_S."""
        for attempt in (1, 2):
            try:
                return await asyncio.wait_for(
                    self._handle().admit.remote(tenant.name, tenant.quota, tokens),
                    LEDGER_TIMEOUT_S)
            except asyncio.TimeoutError:
                break
            except Exception as error:  # noqa: BLE001 - only "the actor is gone" is retried
                if type(error).__name__ not in QUOTA_ACTOR_ERRORS or attempt == 2:
                    raise
                logger.warning("the quota ledger actor is gone (%s); asking for it again",
                               type(error).__name__)
                self._actor = None
        raise OpenAIHTTPError(503, "The quota ledger did not answer; retry later.",
                              "service_unavailable", headers={"Retry-After": "1"})

    def release(self, lease_id: int, used_tokens: int) -> None:
        """Sent without waiting: the request is over; a lost release only delays a refund
        (the ledger drops a lease nobody released after its time to live)."""
        task = asyncio.ensure_future(self._release(lease_id, used_tokens))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, lease_id: int, used_tokens: int) -> None:
        try:
            await self._handle().release.remote(lease_id, used_tokens)
        except Exception as error:  # noqa: BLE001 - logged: the request already ended
            logger.warning("a quota release was lost: %s", type(error).__name__)


def duration_text(seconds: float) -> str:
    """OpenAI's reset format: "17ms", "1s", "2.5s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest, 3):g}s"


def rate_limit_headers(admission: Admission) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits the tenant has."""
    headers: dict[str, str] = {}
    for kind, limit in (("requests", admission.requests), ("tokens", admission.tokens)):
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(limit.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = duration_text(limit.reset_s)
    return headers


def _describe(kind: str, limit: Limit | None, tenant: TenantConfig) -> str:
    if kind == "concurrent":
        return f"concurrent requests: limit {tenant.quota.max_concurrent_requests}"
    per_minute = "tokens per min (TPM)" if kind == "tokens" else "requests per min (RPM)"
    if limit is None:
        return per_minute
    return f"{per_minute}: limit {limit.limit}, remaining {limit.remaining}"


def rate_limited(admission: Admission, tenant: TenantConfig, tokens: int) -> OpenAIHTTPError:
    """The 429 for a refused admission, in OpenAI's shape."""
    kind = admission.refusal or "requests"
    limit = admission.tokens if kind == "tokens" else admission.requests
    headers = rate_limit_headers(admission)
    what = _describe(kind, limit, tenant)
    if admission.retry_after_s is None:
        message = (f"Request too large for tenant {tenant.name} on {what}; requested {tokens}"
                   " (prompt + n x max_tokens). Reduce the prompt or max_tokens.")
    else:
        wait = max(1, math.ceil(admission.retry_after_s))
        headers["Retry-After"] = str(wait)
        message = (f"Rate limit reached for tenant {tenant.name} on {what}; requested "
                   f"{tokens if kind == 'tokens' else 1}. Please try again in {wait}s.")
    return OpenAIHTTPError(429, message, "tokens" if kind == "tokens" else "requests",
                           code="rate_limit_exceeded", headers=headers)
