"""The cluster's LoRA adapter registry (deploy/lora_registry.py) and the unload race.

The registry's rules, pure; then the REAL HTTP app in process (httpx over ASGI, LocalEngineClient
around the REAL AsyncLLMEngine, tiny random model): two ingresses sharing one registry list and
serve the same adapters, and an unload that races a request the ingress already admitted
leaves no engine holding the adapter. The two ingresses share one engine here (the Ray test,
tests/integration/test_lora_serve.py, runs two real ingress replicas).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.errors import OpenAIHTTPError
from iterserve.deploy.lora_registry import AdapterEntry, AdapterRegistry, LocalAdapterRegistry
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.replica import AsyncLLMEngine, EngineConfig, SamplingParams
from iterserve.replica.engine_lora import AdapterInUseError
from iterserve.replica.lora_adapter import LoRARequest
from iterserve.replica.make_model import write_model
from tests.unit.lora_testlib import make_adapter

PROMPT = [11, 42, 97, 300, 5, 8, 13]


def test_a_load_is_pending_until_published_then_current() -> None:
    registry = AdapterRegistry()
    entry = registry.add("sql", "/a/sql")
    assert entry == AdapterEntry("/a/sql", 1)
    assert registry.loaded() == {} and not registry.is_current("sql", 1)
    assert registry.add("sql", "/a/other") is None  # the name is taken while it loads
    registry.publish("sql", 1)
    assert registry.loaded() == {"sql": entry} and registry.is_current("sql", 1)


def test_an_unload_retires_then_drops_or_is_published_again() -> None:
    registry = AdapterRegistry()
    registry.publish("sql", registry.add("sql", "/a/sql").version)
    retired = registry.retire("sql")
    assert retired is not None and registry.loaded() == {}
    assert not registry.is_current("sql", retired.version)  # no replica reads it back now
    assert registry.retire("sql") is None  # one unload at a time
    registry.publish("sql", retired.version)  # a replica refused (409): served again
    assert registry.is_current("sql", retired.version)
    registry.retire("sql")
    registry.drop("sql", retired.version)
    assert registry.loaded() == {} and registry.retire("sql") is None


def test_a_reload_gets_a_new_version_and_the_old_one_stays_unloaded() -> None:
    registry = AdapterRegistry()
    first = registry.add("sql", "/a/sql")
    registry.publish("sql", first.version)
    registry.retire("sql")
    registry.drop("sql", first.version)
    second = registry.add("sql", "/a/sql")
    registry.publish("sql", second.version)
    assert second.version > first.version
    assert not registry.is_current("sql", first.version)  # a request admitted before
    registry.drop("sql", first.version)  # a stale drop does not touch the new load
    assert registry.is_current("sql", second.version)


def test_a_new_registry_restores_what_a_dead_one_served_with_its_versions() -> None:
    """What RayAdapterRegistry restores into the empty actor found after the old one died:
    the adapters it last read, current at the same versions (requests admitted before keep
    theirs); a name the new registry already knows is kept; new loads get newer versions."""
    dead = AdapterRegistry()
    for name in ("sql", "chat"):
        dead.publish(name, dead.add(name, f"/a/{name}").version)
    dead.add("pending", "/a/pending")  # a load in flight when it died: not in loaded()
    fresh = AdapterRegistry()
    fresh.publish("chat", fresh.add("chat", "/b/chat").version)  # loaded again meanwhile
    fresh.restore(dead.loaded())
    assert fresh.is_current("sql", 1) and fresh.loaded()["chat"] == AdapterEntry("/b/chat", 1)
    assert "pending" not in fresh.loaded()
    assert fresh.add("new", "/a/new") == AdapterEntry("/a/new", 3)  # after sql's 1, chat's 2
    fresh.restore(dead.loaded())  # a second ingress restoring the same: nothing changes
    assert set(fresh.loaded()) == {"sql", "chat"}


def test_the_unload_wait_is_a_setting_of_zero_or_more_seconds() -> None:
    assert EngineConfig.from_kwargs(enable_lora=True).lora_unload_wait_s == 60.0
    with pytest.raises(ValueError, match="lora_unload_wait_s must be >= 0 seconds, got -1"):
        EngineConfig.from_kwargs(enable_lora=True, lora_unload_wait_s=-1)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lora_registry")
    base = write_model(folder / "base", seed=3)
    make_adapter(base, folder / "adapters" / "qv", ["q_proj", "v_proj"], seed=1)
    return folder


@pytest.fixture(scope="module")
def engine(root: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(
        model=str(root / "base"), dtype="float32", enable_lora=True, max_lora_rank=8,
        runtime_lora_root=str(root / "adapters"), max_num_batched_tokens=64))
    yield engine
    engine.shutdown()


class HeldClient(LocalEngineClient):
    """The hop from ingress to replica (Serve's handle) made to wait on `gate`: a request
    the ingress admitted is held there while the test unloads its adapter."""

    def __init__(self, engine: AsyncLLMEngine, adapters: LocalAdapterRegistry) -> None:
        super().__init__(engine, adapters)
        self.gate = asyncio.Event()
        self.held = asyncio.Event()

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:  # noqa: ANN401
        self.held.set()
        await self.gate.wait()
        async for item in super().generate(*args, **kwargs):
            yield item


def ingress(client: LocalEngineClient) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(create_app(client, IngressSettings())),
                             base_url="http://ingress", timeout=60)


async def complete(http: httpx.AsyncClient, model: str) -> httpx.Response:
    return await http.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                    "max_tokens": 4, "temperature": 0})


def test_two_ingresses_share_the_registry(engine: AsyncLLMEngine) -> None:
    """A load through one ingress is listed and served by the other at once; an unload
    through the other is seen by the first; a new ingress (a restart) finds the loads."""
    shared = LocalAdapterRegistry()

    async def run() -> None:
        async with ingress(LocalEngineClient(engine, shared)) as a, \
                ingress(LocalEngineClient(engine, shared)) as b:
            assert [m["id"] for m in (await b.get("/v1/models")).json()["data"]][1:] == []
            loaded = await a.post("/v1/load_lora_adapter",
                                  json={"lora_name": "shared-qv", "lora_path": "qv"})
            assert loaded.status_code == 200, loaded.text
            listed = (await b.get("/v1/models")).json()["data"]
            assert [(m["id"], m["parent"]) for m in listed][1:] == [("shared-qv", listed[0]["id"])]
            served = await complete(b, "shared-qv")
            assert served.status_code == 200 and served.json()["model"] == "shared-qv"
            async with ingress(LocalEngineClient(engine, shared)) as restarted:
                assert (await complete(restarted, "shared-qv")).status_code == 200
            again = await b.post("/v1/load_lora_adapter",
                                 json={"lora_name": "shared-qv", "lora_path": "qv"})
            assert again.status_code == 400 and "already been loaded" in again.text
            assert (await b.post("/v1/unload_lora_adapter",
                                 json={"lora_name": "shared-qv"})).status_code == 200
            gone = await complete(a, "shared-qv")
            assert gone.status_code == 404 and "shared-qv" in gone.json()["error"]["message"]
            assert [m["id"] for m in (await a.get("/v1/models")).json()["data"]][1:] == []

    asyncio.run(run())
    assert "shared-qv" not in engine.list_loras()


def test_an_unload_racing_an_admitted_request_leaves_no_engine_holding_it(
        engine: AsyncLLMEngine) -> None:
    """The ingress admits a request for the adapter; before it reaches the replica the
    adapter is unloaded. The request gets the 404 naming it, and the replica does not read
    the adapter back from the folder the request carries (it did before the registry)."""
    client = HeldClient(engine, LocalAdapterRegistry())

    async def run() -> tuple[httpx.Response, int]:
        async with ingress(client) as http:
            loaded = await http.post("/v1/load_lora_adapter",
                                     json={"lora_name": "racy", "lora_path": "qv"})
            assert loaded.status_code == 200, loaded.text
            request = asyncio.ensure_future(complete(http, "racy"))
            await asyncio.wait_for(client.held.wait(), 30)  # admitted, not yet at the replica
            unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "racy"})
            client.gate.set()
            return await request, unload.status_code

    answer, unload_status = asyncio.run(run())
    assert unload_status == 200
    assert answer.status_code == 404 and "racy" in answer.json()["error"]["message"]
    assert "racy" not in engine.list_loras()


def test_an_unload_during_a_read_back_waits_for_it_and_finds_the_request(
        engine: AsyncLLMEngine, root: Path) -> None:
    """An unload that reaches the replica while it reads the adapter back for a request
    (after the registry said "still loaded") waits for the read; then the request is in the
    engine, so the unload is refused (409) and the request ends with its tokens."""
    lora = LoRARequest("mid-read", str(root / "adapters" / "qv"), version=7)
    unloads: list[asyncio.Task[None]] = []

    async def still_loaded(request: LoRARequest) -> bool:
        unloads.append(asyncio.ensure_future(engine.unload_lora(request.name)))
        await asyncio.sleep(0)  # the unload runs up to the lock it waits on
        return True

    async def run() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8),
                                         "mid-read-1", lora_request=lora,
                                         lora_still_loaded=still_loaded):
            tokens.extend(out.new_token_ids)
        with pytest.raises(AdapterInUseError):
            await unloads[0]
        await engine.unload_lora("mid-read")  # once the request ended: dropped
        return tokens

    assert len(asyncio.run(run())) == 8
    assert "mid-read" not in engine.list_loras()


class RefusedElsewhere(LocalEngineClient):
    """A load this engine accepts and another replica refuses (as a 400 from it would)."""

    async def lora_adapter(self, action: str, name: str, path: str | None = None) -> None:
        await super().lora_adapter(action, name, path)
        if action == "load":
            raise OpenAIHTTPError(400, "another replica refused it", "invalid_request_error")


def test_a_load_some_replica_refused_is_dropped_everywhere(engine: AsyncLLMEngine) -> None:
    registry = LocalAdapterRegistry()

    async def run() -> int:
        async with ingress(RefusedElsewhere(engine, registry)) as http:
            answer = await http.post("/v1/load_lora_adapter",
                                     json={"lora_name": "half", "lora_path": "qv"})
            return answer.status_code

    assert asyncio.run(run()) == 400
    assert "half" not in engine.list_loras()  # the replica that read it dropped it again
    assert registry.registry.loaded() == {} and registry.registry.add("half", "/x") is not None


def test_an_unload_outlasted_by_its_requests_is_409_and_the_adapter_served_again(
        engine: AsyncLLMEngine) -> None:
    """With no time to wait (the engine setting lora_unload_wait_s=0) a request still using
    the adapter makes the unload a 409; the adapter is published again, and its request ends
    in full."""
    from iterserve.deploy.lora_adapters import (
        LoadLoRAAdapterRequest,
        LoRAAdapters,
        UnloadLoRAAdapterRequest,
    )

    client = LocalEngineClient(engine, LocalAdapterRegistry())
    adapters = LoRAAdapters(client)

    async def run() -> tuple[int, int]:
        info = await client.model_info()
        assert info.config["lora_unload_wait_s"] == 60.0  # the default, read from the replica
        info = dataclasses.replace(info, config={**info.config, "lora_unload_wait_s": 0.0})
        await adapters.load(LoadLoRAAdapterRequest(lora_name="long", lora_path="qv"), info)
        lora = await adapters.request_for("long", info)
        # long enough that it still runs when the unload asks, even on a loaded machine
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        outputs = engine.generate(PROMPT, params, "long-1", lora_request=lora)
        tokens = len((await outputs.__anext__()).new_token_ids)  # in the engine now
        with pytest.raises(OpenAIHTTPError) as refused:
            await adapters.unload(UnloadLoRAAdapterRequest(lora_name="long"), info)
        assert await client.adapters.is_current("long", lora.version)  # served again
        async for out in outputs:
            tokens += len(out.new_token_ids)
        await adapters.unload(UnloadLoRAAdapterRequest(lora_name="long"), info)
        return refused.value.status_code, tokens

    assert asyncio.run(run()) == (409, 300)
    assert "long" not in engine.list_loras()


def test_a_registry_that_does_not_answer_a_read_back_is_a_503_not_a_500(
        engine: AsyncLLMEngine, root: Path) -> None:
    """A replica that cannot ask the registry (RayAdapterRegistry's timeout) reads nothing
    back and answers the request with the registry's 503 and its Retry-After."""
    from iterserve.deploy.engine_info import stream_engine

    async def unreachable(request: LoRARequest) -> bool:
        raise OpenAIHTTPError(503, "The LoRA adapter registry did not answer; retry later.",
                              "service_unavailable", headers={"Retry-After": "1"})

    async def run() -> list[Any]:
        lora = LoRARequest("unasked", str(root / "adapters" / "qv"), version=3)
        return [item async for item in stream_engine(
            engine, PROMPT, SamplingParams(max_tokens=2), "unasked-1", lora_request=lora,
            lora_still_loaded=unreachable)]

    [info] = asyncio.run(run())
    error = info.to_http()
    assert (error.status_code, error.headers) == (503, {"Retry-After": "1"})
    assert "unasked" not in engine.list_loras()
