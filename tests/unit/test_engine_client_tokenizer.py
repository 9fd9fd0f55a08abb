"""The Serve ingress loads the model's tokenizer once, however many cold requests ask at once.

Found by the node-loss experiment (RELIABILITY.md section 8): the first burst of streaming
requests each loaded its own copy of the tokenizer in a thread, and on a loaded 2-core box
those concurrent loads held every request 12-17 s in the ingress before any reached a
replica. `HandleEngineClient` is driven by a fake handle (no Ray); `load_tokenizer` is
replaced by a slow counting stand-in so that the overlap is certain. The ingress knows the
model's path from the engine config it is given: the tokenizer's load asks no replica.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from iterserve.deploy import engine_client
from iterserve.deploy.engine_client import HandleEngineClient
from iterserve.replica.config import EngineConfig

INFO = {"model_name": "m", "model_path": "/models/m", "max_model_len": 64, "max_logprobs": 5}
ENGINE = EngineConfig.from_kwargs(model="/models/m", max_model_len=64)


class InfoHandle:
    """handle.info.remote() -> INFO; counts the calls."""

    def __init__(self) -> None:
        self.info = self
        self.calls = 0

    def options(self, **_: Any) -> InfoHandle:
        return self

    async def remote(self) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(0.01)
        return INFO


class SlowLoader:
    """Stands in for load_tokenizer: takes 0.1 s, counts calls, returns a distinct object."""

    def __init__(self, fail_first: bool = False) -> None:
        self.paths: list[str | None] = []
        self.fail_first = fail_first
        self._lock = threading.Lock()

    def __call__(self, model_path: str | None) -> object:
        with self._lock:
            self.paths.append(model_path)
            attempt = len(self.paths)
        time.sleep(0.1)
        if self.fail_first and attempt == 1:
            raise OSError("model folder not readable yet")
        return object()


async def _ask(client: HandleEngineClient, n: int) -> list[Any]:
    return await asyncio.gather(*(client.tokenizer() for _ in range(n)), return_exceptions=True)


def test_concurrent_cold_requests_load_the_tokenizer_once(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    loader = SlowLoader()
    monkeypatch.setattr(engine_client, "load_tokenizer", loader)
    handle = InfoHandle()
    client = HandleEngineClient(handle, ENGINE)
    tokenizers = asyncio.run(_ask(client, 16))
    assert loader.paths == ["/models/m"]
    assert handle.calls == 0  # no replica asked
    assert all(t is tokenizers[0] for t in tokenizers)


def test_a_failed_load_is_retried_by_the_next_request(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = SlowLoader(fail_first=True)
    monkeypatch.setattr(engine_client, "load_tokenizer", loader)
    client = HandleEngineClient(InfoHandle(), ENGINE)
    results = asyncio.run(_ask(client, 4))
    failed = [r for r in results if isinstance(r, OSError)]
    loaded = [r for r in results if not isinstance(r, BaseException)]
    # the request that held the lock gets the error; the others, waiting on the lock, load
    # it once more (not once each)
    assert len(failed) == 1 and len(loaded) == 3
    assert len(loader.paths) == 2
    assert all(t is loaded[0] for t in loaded)
