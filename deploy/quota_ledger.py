"""The tenants' quota ledger: one count for the whole cluster (held in one named Ray actor,
deploy/quotas.py), so two ingress replicas cannot give a tenant twice its quota.

Tokens and requests per minute are token buckets, as OpenAI describes its limits: a bucket
holds at most one minute's quota and refills continuously at quota/60 per second, so a
tenant that has been quiet may spend a minute's quota at once and is then held to the rate.
A request is charged prompt + n x max_tokens when admitted (what it may use) and refunded
what it did not use when it ends, so the tokens counted are the tokens served. Concurrent
requests are a count of open leases. A lease no ingress released within `lease_ttl_s` (its
ingress died) is dropped, so a tenant's count cannot leak shut.

Pure Python with an injected clock: the unit tests drive it without Ray or sleeping.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from iterserve.deploy.tenants import TenantQuota

DEFAULT_LEASE_TTL_S = 3600.0


@dataclass
class Bucket:
    """A token bucket of `capacity`, refilled at capacity / 60 per second."""

    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (inf when it never can)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) * 60 / self.capacity)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return (self.capacity - self.level) * 60 / self.capacity


@dataclass(frozen=True)
class Limit:
    """One limit's state after a decision: OpenAI's limit, remaining and reset."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True)
class Admission:
    """The ledger's answer: admitted with a lease id, or refused with the seconds to wait
    (None: the request can never fit, as one asking more tokens than a minute's quota)."""

    lease_id: int | None
    refusal: str | None = None  # which limit refused: "tokens", "requests", "concurrent"
    retry_after_s: float | None = None
    tokens: Limit | None = None
    requests: Limit | None = None

    @property
    def admitted(self) -> bool:
        return self.lease_id is not None


@dataclass
class _Lease:
    tenant: str
    tokens: int
    opened: float


@dataclass
class _TenantState:
    tokens: Bucket | None
    requests: Bucket | None
    open_leases: int = 0


class QuotaLedger:
    """Every tenant's buckets and open leases. The quota travels with each call (each
    ingress holds the config), so a changed quota takes effect at once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        self._clock = clock
        self._lease_ttl_s = lease_ttl_s
        self._tenants: dict[str, _TenantState] = {}
        self._leases: dict[int, _Lease] = {}  # in opening order: the oldest first
        self._ids = itertools.count(1)

    def _state(self, tenant: str, quota: TenantQuota, now: float) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState(None, None)
        state.tokens = _resized(state.tokens, quota.tokens_per_minute, now)
        state.requests = _resized(state.requests, quota.requests_per_minute, now)
        return state

    def _drop_stale_leases(self, now: float) -> None:
        while self._leases:
            lease_id, lease = next(iter(self._leases.items()))
            if now - lease.opened < self._lease_ttl_s:
                return
            del self._leases[lease_id]
            self._tenants[lease.tenant].open_leases -= 1

    def admit(self, tenant: str, quota: TenantQuota, tokens: int) -> Admission:
        """Admit a request that may use `tokens`, or say why not and for how long."""
        now = self._clock()
        self._drop_stale_leases(now)
        state = self._state(tenant, quota, now)
        waits: list[tuple[float, str]] = []
        bound = quota.max_concurrent_requests
        if bound is not None and state.open_leases >= bound:
            waits.append((1.0, "concurrent"))  # a lease's end is not predictable: retry soon
        if state.requests is not None and state.requests.level < 1:
            waits.append((state.requests.wait_for(1), "requests"))
        if state.tokens is not None and state.tokens.level < tokens:
            waits.append((state.tokens.wait_for(tokens), "tokens"))
        if waits:
            wait, refusal = max(waits)
            return Admission(None, refusal, None if math.isinf(wait) else wait,
                             _limit(state.tokens), _limit(state.requests))
        for bucket, amount in ((state.tokens, tokens), (state.requests, 1)):
            if bucket is not None:
                bucket.level -= amount
        state.open_leases += 1
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(tenant, tokens, now)
        return Admission(lease_id, None, None, _limit(state.tokens), _limit(state.requests))

    def release(self, lease_id: int, used_tokens: int) -> None:
        """The request ended having used `used_tokens`: refund the rest of its charge."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:  # dropped as stale, or released twice
            return
        now = self._clock()
        state = self._tenants[lease.tenant]
        state.open_leases -= 1
        if state.tokens is not None:
            state.tokens.refill(now)
            refund = max(0, lease.tokens - used_tokens)
            state.tokens.level = min(state.tokens.capacity, state.tokens.level + refund)


def _resized(bucket: Bucket | None, per_minute: int | None, now: float) -> Bucket | None:
    """The bucket refilled to now, at the quota's size (a new quota: a full bucket)."""
    if per_minute is None:
        return None
    if bucket is None or bucket.capacity != per_minute:
        level = per_minute if bucket is None else min(bucket.level, per_minute)
        return Bucket(float(per_minute), float(level), now)
    bucket.refill(now)
    return bucket


def _limit(bucket: Bucket | None) -> Limit | None:
    if bucket is None:
        return None
    return Limit(int(bucket.capacity), max(0, math.floor(bucket.level)), bucket.reset_s())
