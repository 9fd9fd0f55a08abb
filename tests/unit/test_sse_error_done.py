"""An SSE stream that fails after its first chunk ends with the error event and then
`data: [DONE]`, as vLLM's serving code does; a client that goes away gets neither, and the
engine streams are closed either way."""

from __future__ import annotations

import asyncio
import json

from iterserve.deploy.errors import OpenAIHTTPError
from iterserve.deploy.handlers import _sse_events


class Chunks:
    """Yields `items`, then raises `error` (if any); records aclose()."""

    def __init__(self, items: list[str], error: Exception | None = None) -> None:
        self.items = list(items)
        self.error = error
        self.closed = False

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> str:
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


async def _collect(chunks: Chunks, engine: Chunks, take: int | None = None) -> list[str]:
    events = _sse_events(chunks, engine)  # type: ignore[arg-type]
    out = []
    async for event in events:
        out.append(event)
        if len(out) == take:
            await events.aclose()  # the client went away
            break
    return out


def test_error_event_is_followed_by_done() -> None:
    chunks = Chunks(['{"id": 1}'], OpenAIHTTPError(503, "No engine replica is available",
                                                   code=503))
    engine = Chunks([])
    events = asyncio.run(_collect(chunks, engine))
    assert events[0] == 'data: {"id": 1}\n\n'
    error = json.loads(events[1].removeprefix("data: "))
    assert error["error"]["code"] == 503
    assert events[2:] == ["data: [DONE]\n\n"]
    assert chunks.closed and engine.closed


def test_unexpected_error_is_a_500_event_then_done() -> None:
    chunks, engine = Chunks(["a"], RuntimeError("secret detail")), Chunks([])
    events = asyncio.run(_collect(chunks, engine))
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert "secret" not in error["message"]
    assert events[2:] == ["data: [DONE]\n\n"]


def test_clean_stream_ends_with_one_done() -> None:
    chunks, engine = Chunks(["a", "b"]), Chunks([])
    events = asyncio.run(_collect(chunks, engine))
    assert events == ["data: a\n\n", "data: b\n\n", "data: [DONE]\n\n"]
    assert chunks.closed and engine.closed


def test_client_gone_gets_no_done() -> None:
    chunks, engine = Chunks(["a", "b", "c"]), Chunks([])
    events = asyncio.run(_collect(chunks, engine, take=1))
    assert events == ["data: a\n\n"]
    assert chunks.closed and engine.closed
