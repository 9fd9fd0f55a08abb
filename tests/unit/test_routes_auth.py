"""Every route of the API needs a key except /health, /live and /metrics; keys compare by
digest."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from iterserve.deploy.auth import ApiKeyChecker
from iterserve.deploy.server import IngressSettings, create_app

KEY = "sk-test-0123456789"
OPEN = {"/health", "/live", "/metrics"}


class NoEngine:
    """Routes must refuse before they reach the engine; any call here but /health's readiness
    question is a failure."""

    async def ready(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine client was called ({name}) without a valid key")


def test_only_health_and_metrics_are_open() -> None:
    app = create_app(NoEngine(), IngressSettings(api_keys=(SecretStr(KEY),)))  # type: ignore[arg-type]
    client = TestClient(app)
    routes = app.openapi()["paths"]  # every route of the app, included routers too
    assert set(routes) >= OPEN | {"/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize", "/v1/models", "/debug/replicas"}
    for route, methods in routes.items():
        path = route.replace("{model_id}", "some-model")
        for method in methods:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
                response = client.request(method, path, headers=headers, content=b"{}")
                if route in OPEN:
                    assert response.status_code == 200, (method, path)
                else:
                    assert response.status_code == 401, (method, path, headers)
                    assert response.json()["error"]["type"] == "authentication_error"
    assert client.get("/openapi.json").status_code == 404


def test_a_route_added_to_the_api_router_is_protected_by_default() -> None:
    from iterserve.deploy.routes import api_router

    router = api_router(NoEngine(), 1024, (), lambda request: None)  # type: ignore[arg-type]
    assert router.dependencies, "the key check must sit on the router, not in each route"


@pytest.mark.parametrize("candidate,expected", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"Bearer  {KEY} ", True),
    ("Bearer sk-test-012345678", False), (f"Bearer {KEY}x", False), (KEY, False),
    ("Bearer ", False), (None, False), ("", False), ("Basic abc", False),
])
def test_key_checker(candidate: str | None, expected: bool) -> None:
    checker = ApiKeyChecker([SecretStr("other-key"), SecretStr(KEY)])
    assert (checker.tenant_of(candidate) is not None) is expected
    assert KEY not in repr(checker)


def test_keys_are_held_as_fixed_length_digests() -> None:
    checker = ApiKeyChecker([SecretStr("a"), SecretStr("b" * 500)])
    assert {len(d) for d in checker._digests} == {32}  # compare time independent of key length
    assert ApiKeyChecker([]).tenant_of(None) is not None
