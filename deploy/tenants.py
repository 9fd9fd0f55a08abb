"""Tenants: who is calling, what each may take, and which prefix cache it may read.

Every API key belongs to one tenant (`TenantConfig`): its name, its fair-share weight and
priority band (read by the scheduler's admission and fair-queue work), its quotas (tokens and
requests per minute, requests at once; deploy/quota_ledger.py), an optional TTFT SLO, and its
cache grant. Keys given without a tenant (`--api-key`, ITERSERVE_API_KEYS, a keys file's bare
lines, or no key at all) belong to the implicit `default` tenant, which has no quota and
reads the shared cache namespace: a plain key list serves as it always did.

Cache isolation: with `tenant_cache_isolation` on (the default) a tenant's requests live in
the cache namespace `cache_namespace(salt=<tenant>)`, so no tenant can tell by timing whether
another sent a prompt (the prompt-cache side channel vLLM's `cache_salt` answers); a tenant
whose config names a `cache_share` group uses the group's name instead, so the tenants of one
group share their cached blocks (a common system prompt) and no one else's. A request's own
`cache_salt` (vLLM's field) narrows its namespace further inside its tenant's.

Sub-tenants: where a tenant allows it (`sub_tenant_from=header|user`), the
`X-Iterserve-Sub-Tenant` header or OpenAI's `user` field names a sub-tenant inside the key
(for the per-tenant metrics); one not in the tenant's `sub_tenants` list is a 400, or, with
`unknown_sub_tenant=parent`, counted as the tenant itself. A sub-tenant shares its tenant's
quotas and cache namespace: the key holder is the trust boundary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from iterserve.replica.block_keys import CacheNamespace, cache_namespace

DEFAULT_TENANT = "default"
SUB_TENANT_HEADER = "x-iterserve-sub-tenant"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
SubTenantSource = Literal["none", "header", "user"]
UnknownSubTenant = Literal["reject", "parent"]


def check_name(kind: str, name: str) -> str:
    """A tenant, sub-tenant or group name: 1-64 of letters, digits, `_.-`, no leading mark
    (so `tenant/salt` joins unambiguously and a metric label stays tame)."""
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"{kind} {name[:80]!r} must be 1-64 letters, digits or _.- "
                         "(starting with a letter or digit)")
    return name


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's limits; None: unlimited. Counted across every ingress replica."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent_requests: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute", "max_concurrent_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.tokens_per_minute, self.requests_per_minute,
                                            self.max_concurrent_requests))


@dataclass(frozen=True)
class TenantConfig:
    """One tenant (a keys file's `tenant NAME key=value ...` line)."""

    name: str
    weight: float = 1.0
    priority: int = 0  # priority band: lower is served first, as the engine's `priority`
    quota: TenantQuota = field(default_factory=TenantQuota)
    ttft_slo_ms: float | None = None
    cache_share: str | None = None  # a group name: the tenants naming it share cached blocks
    sub_tenant_from: SubTenantSource = "none"
    sub_tenants: tuple[str, ...] = ()  # the sub-tenants it may name; empty: any name
    unknown_sub_tenant: UnknownSubTenant = "reject"

    def __post_init__(self) -> None:
        check_name("tenant", self.name)
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        if self.ttft_slo_ms is not None and not self.ttft_slo_ms > 0:
            raise ValueError(f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
        if self.cache_share is not None:
            check_name("cache_share group", self.cache_share)
        for name in self.sub_tenants:
            check_name("sub-tenant", name)
        if self.sub_tenant_from not in ("none", "header", "user"):
            raise ValueError(f"sub_tenant_from must be none, header or user, got "
                             f"{self.sub_tenant_from!r}")
        if self.unknown_sub_tenant not in ("reject", "parent"):
            raise ValueError(f"unknown_sub_tenant must be reject or parent, got "
                             f"{self.unknown_sub_tenant!r}")

    def cache_salt(self, isolation: bool) -> str | None:
        """The salt of this tenant's cache namespace: its group, else (isolated) its name;
        None for the shared namespace (isolation off, or the implicit default tenant)."""
        if self.cache_share is not None:
            return self.cache_share
        if not isolation or self.name == DEFAULT_TENANT:
            return None
        return self.name


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its tenant (config) and, where allowed, a sub-tenant."""

    tenant: TenantConfig
    sub_tenant: str | None = None

    def cache_namespace(self, isolation: bool, request_salt: str | None) -> CacheNamespace:
        """The request's cache namespace: its tenant's salt, narrowed by its own `cache_salt`
        (vLLM's field); b"" for a plain request of the shared namespace."""
        salt = self.tenant.cache_salt(isolation)
        if request_salt is not None:
            salt = f"{salt or ''}/{request_salt}"  # names have no "/": the join is unambiguous
        return cache_namespace(salt=salt)

    def naming(self, header: str | None, user: str | None) -> Caller:
        """This caller with the sub-tenant its request names, per its tenant's settings.
        Raises ValueError (a 400) for a sub-tenant the tenant does not know, unless the
        tenant counts those as itself."""
        tenant = self.tenant
        named = {"header": header, "user": user}.get(tenant.sub_tenant_from)
        if not named:
            return self
        known = (not tenant.sub_tenants or named in tenant.sub_tenants) \
            and TENANT_NAME.fullmatch(named) is not None
        if known:
            return Caller(tenant, named)
        if tenant.unknown_sub_tenant == "parent":
            return self
        source = SUB_TENANT_HEADER if tenant.sub_tenant_from == "header" else "user"
        raise ValueError(f"{source}: unknown sub-tenant {named[:64]!r} for this API key")


DEFAULT = TenantConfig(DEFAULT_TENANT)
