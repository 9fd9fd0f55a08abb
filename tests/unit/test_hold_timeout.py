"""The ingress's side of scale-to-zero, driven by fake handles (no Ray): a request Serve holds
at the handle waits at most hold_timeout_s for a replica, then ends in a 503 with Retry-After
and is taken out of the handle's queue; the model card, the tokenizer and readiness of a
deployment that scales to zero ask no replica; `/debug/replicas` at zero is an empty list."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from iterserve.deploy import engine_client
from iterserve.deploy.engine_client import HandleEngineClient
from iterserve.deploy.errors import OpenAIHTTPError
from iterserve.replica.config import EngineConfig
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.sampling_params import SamplingParams

ENGINE = EngineConfig.from_kwargs(model="/models/m", max_model_len=64,
                                  served_model_name="m", num_gpu_blocks_override=7)


class HeldStream:
    """A handle's response: given to a replica after `assign_after_s` (None: never)."""

    def __init__(self, assign_after_s: float | None) -> None:
        self.assign_after_s = assign_after_s
        self.cancelled = False

    async def _fetch_future_result_async(self) -> HeldStream:
        if self.assign_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.assign_after_s or 0.0)
        return self

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request_id="r", index=0, new_token_ids=[1], new_text="t",
                            finished=True, finish_reason="length", num_prompt_tokens=3,
                            num_output_tokens=1)

    def cancel(self) -> None:
        self.cancelled = True


class ZeroReplicas(Exception):
    """Named like ray.serve.exceptions.DeploymentUnavailableError."""


class FakeHandle:
    """No replica: info() fails the test if called; broadcast finds none."""

    def __init__(self, assign_after_s: float | None) -> None:
        self.assign_after_s = assign_after_s
        self.streams: list[HeldStream] = []
        self.generate = self
        self.info = self

    def options(self, **_: Any) -> FakeHandle:  # noqa: ANN401
        return self

    def remote(self, *args: Any, **kwargs: Any) -> HeldStream:  # noqa: ANN401
        if not args:
            raise AssertionError("a replica was asked for its info")
        stream = HeldStream(self.assign_after_s)
        self.streams.append(stream)
        return stream

    def broadcast(self, name: str) -> Any:  # noqa: ANN401
        raise type("DeploymentUnavailableError", (ZeroReplicas,), {})("no replica")


async def generate(client: HandleEngineClient) -> list[RequestOutput]:
    return [out async for out in client.generate([1, 2, 3], SamplingParams(max_tokens=1), "r")]


def test_a_request_held_past_the_timeout_gets_a_503_with_retry_after() -> None:
    handle = FakeHandle(assign_after_s=None)
    client = HandleEngineClient(handle, ENGINE, scales_to_zero=True, hold_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(OpenAIHTTPError) as info:
        asyncio.run(generate(client))
    waited = time.monotonic() - started
    assert info.value.status_code == 503 and info.value.headers["Retry-After"] == "1"
    assert 0.3 <= waited < 1.0
    assert [s.cancelled for s in handle.streams] == [True]  # out of the handle's queue


def test_a_request_taken_within_the_timeout_is_served() -> None:
    handle = FakeHandle(assign_after_s=0.1)
    client = HandleEngineClient(handle, ENGINE, scales_to_zero=True, hold_timeout_s=1.0)
    outs = asyncio.run(generate(client))
    assert [o.new_text for o in outs] == ["t"] and not handle.streams[0].cancelled


def test_retry_after_follows_the_hold_timeout_up_to_a_minute() -> None:
    for hold, retry in ((0.3, "1"), (2.5, "3"), (300.0, "60")):
        error = engine_client.held_too_long(hold)
        assert error.headers["Retry-After"] == retry and error.status_code == 503
    with pytest.raises(ValueError, match="hold_timeout_s"):
        HandleEngineClient(FakeHandle(None), ENGINE, hold_timeout_s=0)


class Loaded:
    vocab_size = 99


def test_model_card_and_readiness_at_zero_ask_no_replica(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(engine_client, "load_tokenizer", lambda path: Loaded())
    client = HandleEngineClient(FakeHandle(None), ENGINE, scales_to_zero=True)

    async def probe() -> tuple[bool, Any, list[dict[str, Any]]]:
        return await client.ready(), await client.model_info(), await client.replica_infos()

    ready, info, replicas = asyncio.run(probe())
    assert ready and replicas == []
    assert (info.model_name, info.model_path, info.max_model_len, info.vocab_size) == (
        "m", "/models/m", 64, 99)
    assert info.config["num_gpu_blocks"] == 7 and info.config["max_model_len"] == 64


def test_replicas_kept_readiness_waits_for_a_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """min_replicas >= 1: ready only once a replica answered (unchanged), and the card then
    carries the KV blocks it found."""
    monkeypatch.setattr(engine_client, "load_tokenizer", lambda path: Loaded())

    class OneReplica(FakeHandle):
        def remote(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            if args:
                return super().remote(*args, **kwargs)
            return self._info()

        async def _info(self) -> dict[str, Any]:
            return {"config": {"num_gpu_blocks": 123}}

    kept = HandleEngineClient(OneReplica(None), ENGINE)
    zero = HandleEngineClient(FakeHandle(None), ENGINE)  # replicas kept, none answers

    async def probe() -> tuple[bool, bool, Any]:
        return await kept.ready(), await zero.ready(), await kept.model_info()

    kept_ready, zero_ready, info = asyncio.run(probe())
    assert kept_ready and not zero_ready
    assert info.config["num_gpu_blocks"] == 123
