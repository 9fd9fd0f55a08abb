"""A request whose replica dies before producing anything is sent again (bug B5).

Found by test_replica_crash.py with CRASH_CLIENTS=24 (requests queued in the killed replica's
engine): they fail with a 503 although nothing had reached the client, so the ingress could
have sent them to the surviving replica. HandleEngineClient is driven here by a fake handle
(no Ray): its first stream fails with an error named like Ray's ActorDiedError before yielding,
the second succeeds. A replica death AFTER the first token must not be retried (the client
already has part of the output).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from iterserve.deploy.engine_client import MAX_ATTEMPTS, HandleEngineClient
from iterserve.deploy.errors import OpenAIHTTPError
from iterserve.replica.config import EngineConfig
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.sampling_params import SamplingParams

ENGINE = EngineConfig.from_kwargs(model="/models/m")


class ActorDiedError(Exception):
    """Named like ray.exceptions.ActorDiedError (the mapping goes by class name)."""


def output(token: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id="r", index=0, new_token_ids=[token], new_text=f"t{token}",
                         finished=finished, finish_reason="length" if finished else None,
                         num_prompt_tokens=3, num_output_tokens=token)


class FakeStream:
    def __init__(self, items: list[Any]) -> None:
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        for item in self._items:
            await asyncio.sleep(0)
            if isinstance(item, BaseException):
                raise item
            yield item

    async def _fetch_future_result_async(self) -> FakeStream:
        return self  # given to a replica at once

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """handle.options(stream=True).generate.remote(...) -> the next scripted stream."""

    def __init__(self, scripts: list[list[Any]]) -> None:
        self.scripts = scripts
        self.calls = 0
        self.generate = self

    def options(self, **_: Any) -> FakeHandle:
        return self

    def remote(self, *_: Any, **__: Any) -> FakeStream:
        stream = FakeStream(self.scripts[min(self.calls, len(self.scripts) - 1)])
        self.calls += 1
        return stream


async def collect(client: HandleEngineClient) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=2)
    return [out async for out in client.generate([1, 2, 3], params, "r")]


def test_replica_death_before_first_token_is_retried() -> None:
    handle = FakeHandle([[ActorDiedError("replica killed")],
                         [output(1, False), output(2, True)]])
    outs = asyncio.run(collect(HandleEngineClient(handle, ENGINE)))
    assert [o.new_text for o in outs] == ["t1", "t2"] and handle.calls == 2


def test_replica_death_after_first_token_is_not_retried() -> None:
    handle = FakeHandle([[output(1, False), ActorDiedError("replica killed")],
                         [output(1, False), output(2, True)]])
    with pytest.raises(OpenAIHTTPError) as info:
        asyncio.run(collect(HandleEngineClient(handle, ENGINE)))
    assert info.value.status_code == 503 and handle.calls == 1


def test_replica_death_every_time_ends_in_503() -> None:
    handle = FakeHandle([[ActorDiedError("replica killed")]])
    with pytest.raises(OpenAIHTTPError) as info:
        asyncio.run(collect(HandleEngineClient(handle, ENGINE)))
    assert info.value.status_code == 503 and info.value.headers.get("Retry-After")
    assert handle.calls == MAX_ATTEMPTS  # bounded: a few attempts, then a 503
