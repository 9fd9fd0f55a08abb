"""API keys: where they come from and how a request's Bearer token is checked.

Keys come from `--api-key` (repeatable), the env var ITERSERVE_API_KEYS (comma separated) and
an optional file (one key per line, `#` comments). With no key configured the API is open.
Keys are compared with `hmac.compare_digest` against every configured key, and are never
logged, echoed in errors or shown in a repr.
"""

from __future__ import annotations

import hmac
import os
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
    """Checks `Authorization: Bearer <key>` headers against the configured keys."""

    def __init__(self, keys: Iterable[SecretStr]) -> None:
        self._keys = tuple(k.get_secret_value().encode() for k in keys)

    def __repr__(self) -> str:
        return f"ApiKeyChecker(num_keys={len(self._keys)})"

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        if not self._keys:
            return True
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        candidate = token.strip().encode()
        ok = False
        for key in self._keys:  # compare with every key: no early exit on a match
            ok |= hmac.compare_digest(candidate, key)
        return ok
