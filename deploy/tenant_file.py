"""The API keys file: keys, and (optionally) the tenants they belong to.

One entry a line; `#` starts a comment line; blank lines are skipped:

    tenant acme weight=2 priority=0 tokens_per_minute=60000 requests_per_minute=600 \
max_concurrent_requests=8 ttft_slo_ms=800 cache_share=docs sub_tenant_from=user \
sub_tenants=alice,bob unknown_sub_tenant=reject
    sk-acme-1 acme          # a key, then its tenant
    sk-legacy               # a bare key: the default tenant (no quota, shared cache)

A `tenant` line may come before or after its keys; a key naming a tenant that no line
defines, a key listed twice, an unknown setting or a bad value stops start-up with a
ValueError naming the file and line. Today's plain files (one key per line) parse unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from iterserve.deploy.tenants import (
    DEFAULT,
    DEFAULT_TENANT,
    TenantConfig,
    TenantQuota,
    check_name,
)

INLINE_COMMENT = re.compile(r"\s#")


def _names(value: str) -> tuple[str, ...]:
    return tuple(v for v in value.split(",") if v)


# setting -> (where it goes: "quota" or "tenant", its parser)
SETTINGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "weight": ("tenant", float),
    "priority": ("tenant", int),
    "ttft_slo_ms": ("tenant", float),
    "cache_share": ("tenant", str),
    "sub_tenant_from": ("tenant", str),
    "sub_tenants": ("tenant", _names),
    "unknown_sub_tenant": ("tenant", str),
    "tokens_per_minute": ("quota", int),
    "requests_per_minute": ("quota", int),
    "max_concurrent_requests": ("quota", int),
}


@dataclass(frozen=True)
class TenantKeys:
    """Every configured key with its tenant's name, and every tenant by name."""

    keys: tuple[tuple[SecretStr, str], ...] = ()
    tenants: tuple[TenantConfig, ...] = (DEFAULT,)

    def __repr__(self) -> str:  # never show keys
        return f"TenantKeys(num_keys={len(self.keys)}, tenants={[t.name for t in self.tenants]})"

    def with_keys(self, keys: tuple[SecretStr, ...], tenant: str = DEFAULT_TENANT
                  ) -> TenantKeys:
        """These keys added for `tenant` (a key already listed keeps its first tenant only
        when it is the same one)."""
        known = {k.get_secret_value(): t for k, t in self.keys}
        added = list(self.keys)
        for key in keys:
            secret = key.get_secret_value()
            if secret in known:
                if known[secret] != tenant:
                    raise ValueError(f"an API key is given for tenant {tenant!r} and, in the "
                                     f"keys file, for tenant {known[secret]!r}")
                continue
            known[secret] = tenant
            added.append((key, tenant))
        return TenantKeys(tuple(added), self.tenants)


def parse_tenant_line(words: list[str]) -> TenantConfig:
    """`tenant NAME key=value ...` as a TenantConfig (ValueError for anything wrong)."""
    if len(words) < 2:
        raise ValueError("a tenant line needs a name: tenant NAME key=value ...")
    name = check_name("tenant", words[1])
    tenant_kwargs: dict[str, Any] = {}
    quota_kwargs: dict[str, Any] = {}
    for word in words[2:]:
        key, eq, value = word.partition("=")
        if not eq or not value:
            raise ValueError(f"{word[:40]!r} is not key=value")
        if key not in SETTINGS:
            raise ValueError(f"unknown tenant setting {key!r} (known: {', '.join(SETTINGS)})")
        where, parse = SETTINGS[key]
        target = quota_kwargs if where == "quota" else tenant_kwargs
        if key in target:
            raise ValueError(f"{key} is given twice")
        try:
            target[key] = parse(value)
        except ValueError:
            raise ValueError(f"{key}={value[:40]!r} is not a valid {parse.__name__}") from None
    return TenantConfig(name, quota=TenantQuota(**quota_kwargs), **tenant_kwargs)


def parse_keys_file(text: str, source: str = "keys file") -> TenantKeys:
    """The keys and tenants of a keys file's text; ValueError naming `source`:line."""
    tenants: dict[str, TenantConfig] = {DEFAULT_TENANT: DEFAULT}
    defined_at: dict[str, int] = {}
    keys: list[tuple[str, str, int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        # A comment starts a line or follows a space: a key may hold "#" (as before).
        words = [] if line.strip().startswith("#") else INLINE_COMMENT.split(line, 1)[0].split()
        if not words:
            continue
        try:
            if words[0] == "tenant":
                tenant = parse_tenant_line(words)
                if tenant.name in defined_at:
                    raise ValueError(f"tenant {tenant.name!r} is already defined on line "
                                     f"{defined_at[tenant.name]}")
                tenants[tenant.name] = tenant
                defined_at[tenant.name] = number
            elif len(words) <= 2:
                keys.append((words[0], words[1] if len(words) == 2 else DEFAULT_TENANT, number))
            else:
                raise ValueError("a key line is the key, then at most its tenant's name")
        except ValueError as error:
            raise ValueError(f"{source}:{number}: {error}") from None
    seen: dict[str, int] = {}
    pairs = []
    for key, tenant_name, number in keys:
        if tenant_name not in tenants:
            raise ValueError(f"{source}:{number}: the key names tenant {tenant_name!r}, which "
                             "no `tenant` line defines")
        if key in seen:
            raise ValueError(f"{source}:{number}: this key is already listed on line "
                             f"{seen[key]}")
        seen[key] = number
        pairs.append((SecretStr(key), tenant_name))
    return TenantKeys(tuple(pairs), tuple(tenants.values()))


def read_keys_file(path: str) -> TenantKeys:
    """The keys file at `path` (ValueError when it is missing or malformed)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"API key file {str(file)!r} does not exist")
    return parse_keys_file(file.read_text(), str(file))
