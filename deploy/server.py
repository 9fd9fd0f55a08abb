"""The FastAPI app of the OpenAI-compatible API, built over any EngineClient.

`create_app` assembles it: the routes of `deploy/routes.py` (every one behind the API-key
dependency except /health, /live and /metrics), and error handlers that turn every failure into an
OpenAI-shaped error body (bad input is never a 500).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.deploy.auth import ApiKeyChecker
from iterserve.deploy.engine_client import EngineClient
from iterserve.deploy.errors import (
    OpenAIHTTPError,
    from_validation_error,
    internal_error,
    unauthorized,
)
from iterserve.deploy.lifecycle import DrainGate, ServingState
from iterserve.deploy.routes import api_router, open_router
from iterserve.deploy.tenant_requests import Tenancy
from iterserve.deploy.tenants import DEFAULT, DEFAULT_TENANT, Caller, TenantConfig
from iterserve.deploy.tool_calls import ToolSettings

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class IngressSettings:
    """HTTP-level settings of one ingress (engine settings live in EngineConfig)."""

    # Bare keys (the default tenant's) or (key, tenant name) pairs (deploy/tenant_file.py).
    api_keys: tuple[SecretStr | tuple[SecretStr, str], ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_aliases: tuple[str, ...] = field(default=())  # extra names accepted as `model`
    tools: ToolSettings = field(default_factory=ToolSettings)  # --chat-template, --tool-call-parser
    tenants: tuple[TenantConfig, ...] = (DEFAULT,)  # every tenant a key may name
    tenant_cache_isolation: bool = True  # each tenant's cached blocks in its own namespace

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        names = {t.name for t in self.tenants}
        for key in self.api_keys:
            if isinstance(key, tuple) and key[1] not in names:
                raise ValueError(f"an API key names tenant {key[1]!r}, which is not configured")
        if DEFAULT_TENANT not in names:
            raise ValueError("tenants must include the default tenant")

    def __repr__(self) -> str:  # never show keys
        return (f"IngressSettings(num_api_keys={len(self.api_keys)}, "
                f"tenants={[t.name for t in self.tenants]}, "
                f"max_body_bytes={self.max_body_bytes})")


def create_app(client: EngineClient, settings: IngressSettings | None = None,
               state: ServingState | None = None, tenancy: Tenancy | None = None) -> FastAPI:
    """The API over `client`; the Serve ingress and in-process tests build it the same way.

    Every route lives on the router of `deploy/routes.py` that requires a key, except the
    three on its open router (/health, /live, /metrics): a new route is protected unless put
    there. `state` is the ingress's drain flag and in-flight count (deploy/lifecycle.py).
    `tenancy`: the tenants' quota ledger and metrics (default: a ledger in this process, no
    metrics), with the settings' cache isolation.
    """
    settings = settings or IngressSettings()
    tenancy = dataclasses.replace(tenancy or Tenancy(),
                                  cache_isolation=settings.tenant_cache_isolation)
    state = state if state is not None else ServingState()
    app = FastAPI(title="iterserve", version="0.1.0", docs_url=None, redoc_url=None,
                  openapi_url=None)  # no open schema route: the route list is not public
    install_error_handlers(app)
    app.add_middleware(DrainGate, state=state)
    app.include_router(open_router(client, state))
    app.include_router(api_router(client, settings.max_body_bytes, settings.model_aliases,
                                  require_api_key(settings), settings.tools, tenancy))
    return app


def require_api_key(settings: IngressSettings) -> Callable[[Request], None]:
    """A FastAPI dependency: 401 unless the request's Bearer key is configured (or none is);
    the key's tenant is left on `request.state.caller` (deploy/tenants.py `Caller`)."""
    keys = ApiKeyChecker(settings.api_keys)
    callers = {t.name: Caller(t) for t in settings.tenants}

    def check(request: Request) -> None:
        tenant = keys.tenant_of(request.headers.get("authorization"))
        if tenant is None:
            raise unauthorized()
        request.state.caller = callers[tenant]

    return check


def install_error_handlers(app: FastAPI) -> None:
    """Every failure becomes an OpenAI-shaped error body; bad input is never a 500."""

    @app.exception_handler(OpenAIHTTPError)
    async def _openai_error(request: Request, error: OpenAIHTTPError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError
                                ) -> JSONResponse:
        return from_validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return OpenAIHTTPError(error.status_code, str(error.detail), err_type).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()
