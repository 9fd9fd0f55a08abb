"""API keys: where they come from and how a request's Bearer token is checked.

Keys come from `--api-key` (repeatable), the env var ITERSERVE_API_KEYS (comma separated) and
an optional file (one key per line, `#` comments). With no key configured the API is open.
Keys are compared as HMAC-SHA256 digests against every configured key (`ApiKeyChecker`), and
are never logged, echoed in errors or shown in a repr.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from pydantic import SecretStr

API_KEYS_ENV = "ITERSERVE_API_KEYS"


def load_api_keys(
    keys: Iterable[str | SecretStr] = (),
    key_file: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[SecretStr, ...]:
    """All configured keys: explicit ones, the env var's, the file's; blanks dropped."""
    env = os.environ if env is None else env
    found: list[str] = []
    for key in keys:
        found.append(key.get_secret_value() if isinstance(key, SecretStr) else str(key))
    found.extend(env.get(API_KEYS_ENV, "").split(","))
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise ValueError(f"API key file {str(path)!r} does not exist")
        for line in path.read_text().splitlines():
            if not line.strip().startswith("#"):
                found.append(line)
    unique = dict.fromkeys(k.strip() for k in found if k.strip())
    return tuple(SecretStr(k) for k in unique)


class ApiKeyChecker:
    """Checks `Authorization: Bearer <key>` headers against the configured keys.

    Keys are kept and compared as HMAC-SHA256 digests under a per-process random salt: every
    comparison is between two 32-byte digests, so its time reveals neither a key's bytes nor
    its length, and every configured key is compared (no early exit on a match).
    """

    def __init__(self, keys: Iterable[SecretStr]) -> None:
        self._salt = secrets.token_bytes(32)
        self._digests = tuple(self._digest(k.get_secret_value().encode()) for k in keys)

    def _digest(self, key: bytes) -> bytes:
        return hmac.new(self._salt, key, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"ApiKeyChecker(num_keys={len(self._digests)})"

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        if not self._digests:
            return True
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        candidate = self._digest(token.strip().encode())
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(candidate, digest)
        return ok
