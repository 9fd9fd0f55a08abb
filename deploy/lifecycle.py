"""What one ingress knows of its own lifecycle: draining or not, and its requests in flight.

`iterserve serve` drains on SIGTERM or SIGINT (deploy/shutdown.py) by telling every ingress
to stop admitting (`ServingState.draining`): from then on `/health` answers 503, so load
balancers and readiness probes take the server out, and every API route answers 503 with
Retry-After, while the requests already admitted run to their end. `/live` and `/metrics`
keep answering. `DrainGate` is the ASGI middleware that refuses and counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from iterserve.deploy.errors import OpenAIHTTPError

# Routes that answer during the drain and are not counted as requests in flight: probes and
# scrapes, which a drain must neither wait for nor refuse.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})
RETRY_AFTER_S = 1


@dataclass
class ServingState:
    """One ingress's drain flag and count of admitted API requests not yet fully answered
    (a stream counts until its last byte is handed to the server)."""

    draining: bool = False
    in_flight: int = 0

    def begin_drain(self) -> int:
        """Admit nothing more; returns the requests still in flight."""
        self.draining = True
        return self.in_flight


def draining_error() -> OpenAIHTTPError:
    return OpenAIHTTPError(503, "The server is shutting down and admits no new requests; "
                           "retry on another server.", "service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)})


class DrainGate:
    """ASGI middleware: counts API requests in flight; refuses new ones while draining."""

    def __init__(self, app: ASGIApp, state: ServingState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await _send_error(send, draining_error())
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


async def _send_error(send: Send, error: OpenAIHTTPError) -> None:
    body = json.dumps(error.body()).encode()
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    start: dict[str, Any] = {"type": "http.response.start", "status": error.status_code,
                             "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": body})
