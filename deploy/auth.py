"""API keys: where they come from and how a request's Bearer token is checked.

Keys come from `--api-key` (repeatable), the env var ITERSERVE_API_KEYS (comma separated) and
an optional keys file (deploy/tenant_file.py: one key per line, `#` comments, optionally with
its tenant and the tenants' settings). With no key configured the API is open (every request
is the default tenant's). Keys are compared as HMAC-SHA256 digests against every configured
key (`ApiKeyChecker`), which answers the key's tenant, and are never logged, echoed in errors
or shown in a repr.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable

from pydantic import SecretStr

from iterserve.deploy.tenant_file import TenantKeys, read_keys_file
from iterserve.deploy.tenants import DEFAULT_TENANT

API_KEYS_ENV = "ITERSERVE_API_KEYS"


def load_api_keys(
    keys: Iterable[str | SecretStr] = (),
    key_file: str | None = None,
    env: dict[str, str] | None = None,
) -> TenantKeys:
    """All configured keys with their tenants: the keys file's (with its tenants), then the
    explicit ones and the env var's (the default tenant's); blanks dropped. ValueError for a
    missing or malformed keys file (naming the line)."""
    env = os.environ if env is None else env
    found: list[str] = []
    for key in keys:
        found.append(key.get_secret_value() if isinstance(key, SecretStr) else str(key))
    found.extend(env.get(API_KEYS_ENV, "").split(","))
    unique = dict.fromkeys(k.strip() for k in found if k.strip())
    from_file = read_keys_file(key_file) if key_file else TenantKeys()
    return from_file.with_keys(tuple(SecretStr(k) for k in unique))


class ApiKeyChecker:
    """Checks `Authorization: Bearer <key>` headers against the configured keys.

    Keys are kept and compared as HMAC-SHA256 digests under a per-process random salt: every
    comparison is between two 32-byte digests, so its time reveals neither a key's bytes nor
    its length, and every configured key is compared (no early exit on a match).
    """

    def __init__(self, keys: Iterable[SecretStr | tuple[SecretStr, str]]) -> None:
        """keys: bare keys (the default tenant's) or (key, tenant name) pairs."""
        self._salt = secrets.token_bytes(32)
        pairs = [k if isinstance(k, tuple) else (k, DEFAULT_TENANT) for k in keys]
        self._digests = tuple(self._digest(k.get_secret_value().encode()) for k, _ in pairs)
        self._tenants = tuple(tenant for _, tenant in pairs)

    def _digest(self, key: bytes) -> bytes:
        return hmac.new(self._salt, key, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"ApiKeyChecker(num_keys={len(self._digests)})"

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of the request's Bearer key; None when it is missing or wrong (the
        default tenant when no key is configured)."""
        if not self._digests:
            return DEFAULT_TENANT
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        candidate = self._digest(token.strip().encode())
        found: str | None = None
        for digest, tenant in zip(self._digests, self._tenants, strict=True):
            if hmac.compare_digest(candidate, digest):  # every key compared: no early exit
                found = tenant
        return found
