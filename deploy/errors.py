"""HTTP errors in OpenAI's shape, and the mapping from engine and Ray errors to them.

Every error body is {"error": {"message", "type", "param", "code"}}. Bad input is always a
4xx: pydantic validation errors and malformed JSON are 400, oversized bodies 413, a full
waiting queue 429 with Retry-After, a draining engine 503.

Engine errors cross the Ray handle as `EngineErrorInfo` records, not exceptions: the replica
catches the engine's exceptions and yields one record, so the ingress never depends on how
Ray wraps (and re-pickles) exception classes. `unwrap_ray_error` still handles the
exceptions that Ray itself raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from iterserve.deploy.schemas import ErrorInfo, ErrorResponse
from iterserve.replica.engine_lora import AdapterInUseError
from iterserve.replica.errors import (
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestFailedError,
    SLOUnreachableError,
)
from iterserve.replica.lora_manager import UnknownAdapterError


class OpenAIHTTPError(Exception):
    """Raised anywhere in a request; rendered by the app's exception handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.err_type, param=self.param,
                         code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIHTTPError:
    return OpenAIHTTPError(400, message, "invalid_request_error", param=param)


def model_not_found(model: str) -> OpenAIHTTPError:
    return OpenAIHTTPError(404, f"The model `{model}` does not exist.",
                           "invalid_request_error", param="model", code="model_not_found")


def unauthorized() -> OpenAIHTTPError:
    return OpenAIHTTPError(401, "Incorrect or missing API key; pass it as 'Authorization: "
                           "Bearer <key>'.", "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> OpenAIHTTPError:
    return OpenAIHTTPError(413, f"Request body exceeds the limit of {limit} bytes.",
                           "invalid_request_error", code="request_too_large")


def held_too_long(hold_timeout_s: float) -> OpenAIHTTPError:
    """A request no replica took within the hold timeout (scaling from zero, or every
    replica busy): 503, retry after as long again (at most a minute, what clients honour)."""
    retry_after = min(60, max(1, math.ceil(hold_timeout_s)))
    return OpenAIHTTPError(503, f"No replica took the request within {hold_timeout_s:g} s "
                           "(the model is starting, or every replica is busy); retry later.",
                           "service_unavailable", code="no_replica",
                           headers={"Retry-After": str(retry_after)})


def internal_error(message: str = "Internal server error.") -> OpenAIHTTPError:
    return OpenAIHTTPError(500, message, "internal_server_error")


def from_validation_error(error: ValidationError | Any) -> OpenAIHTTPError:
    """A pydantic / FastAPI validation error as a 400; `param` names the first bad field."""
    errors = error.errors() if hasattr(error, "errors") else []
    if not errors:
        return bad_request(str(error))
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param=param)


@dataclass(frozen=True)
class EngineErrorInfo:
    """An engine error as plain data, yielded by the replica instead of raising."""

    status_code: int
    message: str
    err_type: str
    retry_after_s: float | None = None
    # The replica cannot serve anything now (its engine loop died, or it drains): nothing was
    # started, so the ingress sends the request once more and Serve routes it elsewhere.
    retry_elsewhere: bool = False

    def to_http(self) -> OpenAIHTTPError:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return OpenAIHTTPError(self.status_code, self.message, self.err_type, headers=headers)


def engine_error_info(error: BaseException) -> EngineErrorInfo | None:
    """The record for an engine exception the caller should see, or None for a bug."""
    if isinstance(error, (QueueFullError, SLOUnreachableError)):
        return EngineErrorInfo(429, str(error), "rate_limit_error", error.retry_after_s)
    if isinstance(error, EngineDrainingError):
        return EngineErrorInfo(503, str(error) or "The server is shutting down; retry "
                               "on another replica.", "service_unavailable", 1.0,
                               retry_elsewhere=True)
    if isinstance(error, EngineDeadError):
        return EngineErrorInfo(500, str(error) or "The engine stopped.", "internal_server_error",
                               retry_elsewhere=True)
    if isinstance(error, RequestFailedError):
        return EngineErrorInfo(500, str(error), "internal_server_error")
    if isinstance(error, OpenAIHTTPError):  # the LoRA registry did not answer a replica: 503
        retry = error.headers.get("Retry-After")
        return EngineErrorInfo(error.status_code, error.message, error.err_type,
                               float(retry) if retry else None)
    if isinstance(error, UnknownAdapterError):  # a replica asked to unload what it lacks
        return EngineErrorInfo(404, str(error), "not_found_error")
    if isinstance(error, AdapterInUseError):
        return EngineErrorInfo(409, str(error), "conflict_error")
    if isinstance(error, ValueError):  # LoRALoadError among them: an adapter it cannot serve
        return EngineErrorInfo(400, str(error), "invalid_request_error")
    return None


def unwrap_ray_error(error: BaseException) -> BaseException:
    """The user exception inside a RayTaskError, if any."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def http_error_for(error: BaseException) -> OpenAIHTTPError:
    """Map any exception from the handle path to an OpenAIHTTPError."""
    if isinstance(error, OpenAIHTTPError):
        return error
    inner = unwrap_ray_error(error)
    info = engine_error_info(inner)
    if info is not None:
        return info.to_http()
    name = type(inner).__name__
    if name == "BackPressureError":  # ray.serve.exceptions: max_queued_requests at the handle
        return OpenAIHTTPError(429, "The server is overloaded; retry later.", "rate_limit_error",
                               headers={"Retry-After": "1"})
    if name in ("DeploymentUnavailableError", "ActorDiedError", "RayActorError",
                "ActorUnavailableError"):
        return OpenAIHTTPError(503, "No engine replica is available; retry later.",
                               "service_unavailable", headers={"Retry-After": "1"})
    return internal_error()
