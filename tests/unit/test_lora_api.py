"""LoRA over the real HTTP app in process (TestClient over LocalEngineClient wrapping the REAL
AsyncLLMEngine, tiny random model, fp32): adapters as models with `parent`, 404 naming an
unknown adapter, runtime load/unload gated by the root folder, 400 for a bad adapter, and
an unload that waits for the request still using the adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.replica import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from iterserve.replica.make_model import write_model
from tests.unit.lora_testlib import make_adapter

PROMPT = [11, 42, 97, 300, 5, 8, 13]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_api")
    base = write_model(root / "base", seed=3)
    adapters = root / "adapters"
    make_adapter(base, adapters / "qv", ["q_proj", "v_proj"], seed=1)
    make_adapter(base, adapters / "mlp", ["gate_proj", "up_proj", "down_proj"], seed=2)
    outside = make_adapter(base, root / "outside", ["q_proj"], seed=3)
    bad_rank = make_adapter(base, adapters / "rank16", ["q_proj"], seed=4, rank=16)
    return {"base": base, "root": adapters, "outside": outside, "rank16": bad_rank}


@pytest.fixture(scope="module")
def http(folders: dict[str, Path]) -> TestClient:
    config = EngineConfig.from_kwargs(
        model=str(folders["base"]), dtype="float32", enable_lora=True, max_loras=2,
        max_lora_rank=8, lora_modules=f"qv={folders['root'] / 'qv'}",
        runtime_lora_root=str(folders["root"]), max_num_batched_tokens=64)
    engine = AsyncLLMEngine(config)
    with TestClient(create_app(LocalEngineClient(engine), IngressSettings())) as client:
        yield client
    engine.shutdown()


def complete(http: TestClient, model: str, max_tokens: int = 6) -> dict:
    response = http.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                  "max_tokens": max_tokens, "temperature": 0})
    return {"status": response.status_code, **response.json()}


def test_models_lists_adapters_with_their_parent(http: TestClient) -> None:
    data = http.get("/v1/models").json()["data"]
    base = data[0]["id"]
    assert [(m["id"], m["parent"]) for m in data] == [(base, None), ("qv", base)]
    assert http.get("/v1/models/qv").json()["parent"] == base


def test_adapter_request_gets_the_adapter_tokens(http: TestClient,
                                                 folders: dict[str, Path]) -> None:
    base_model = http.get("/v1/models").json()["data"][0]["id"]
    via_api = complete(http, "qv")
    assert via_api["status"] == 200 and via_api["model"] == "qv"
    offline = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_lora_rank=8,
                  lora_modules=f"qv={folders['root'] / 'qv'}")
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    want = offline.generate([PROMPT], greedy, lora_name="qv")[0].outputs[0].text
    assert via_api["choices"][0]["text"] == want
    assert complete(http, base_model)["choices"][0]["text"] != want


def test_unknown_adapter_is_404_naming_it(http: TestClient) -> None:
    answer = complete(http, "no-such-adapter")
    assert answer["status"] == 404
    assert "`no-such-adapter` does not exist" in answer["error"]["message"]
    assert answer["error"]["code"] == "model_not_found"


def test_runtime_load_then_serve_then_unload(http: TestClient, folders: dict[str, Path]) -> None:
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp",
                                                      "lora_path": str(folders["root"] / "mlp")})
    assert loaded.status_code == 200, loaded.text
    assert "mlp" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert complete(http, "mlp")["status"] == 200
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "mlp"})
    assert again.status_code == 400 and "already been loaded" in again.text
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    assert complete(http, "mlp")["status"] == 404
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert gone.status_code == 404


def test_runtime_load_refuses_paths_outside_the_root(http: TestClient,
                                                     folders: dict[str, Path]) -> None:
    for path in (str(folders["outside"]), "../outside", "/etc"):
        answer = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
        assert answer.status_code == 400 and "outside the runtime LoRA root" in answer.text
    link = folders["root"] / "escape"
    link.symlink_to(folders["outside"])
    answer = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "escape"})
    assert answer.status_code == 400  # a link out of the root is resolved first
    assert "x" not in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_bad_adapters_are_400_naming_the_problem(http: TestClient,
                                                 folders: dict[str, Path]) -> None:
    answer = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": "rank16"})
    assert answer.status_code == 400 and "rank 16, above max_lora_rank=8" in answer.text
    broken = folders["root"] / "broken"
    shutil.copytree(folders["root"] / "qv", broken)
    (broken / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules":
                                                            ["lm_head"]}))
    answer = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "broken"})
    assert answer.status_code == 400 and "targets lm_head, which the model lacks" in answer.text


def test_unload_while_in_use_waits_for_it_and_loses_nothing(http: TestClient) -> None:
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "busy",
                                                    "lora_path": "mlp"}).status_code == 200
    body = {"model": "busy", "prompt": PROMPT, "max_tokens": 64, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "busy" in first  # streaming: the request is in the engine now
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        rest = [line for line in lines if line.startswith("data: ")]
    assert unloaded.status_code == 200, unloaded.text  # once the request ended
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["usage"]["completion_tokens"] == 64
    assert complete(http, "busy")["status"] == 404


def test_runtime_routes_are_off_without_a_root(folders: dict[str, Path]) -> None:
    config = EngineConfig.from_kwargs(model=str(folders["base"]), dtype="float32",
                                      enable_lora=True, max_lora_rank=8)
    engine = AsyncLLMEngine(config)
    with TestClient(create_app(LocalEngineClient(engine), IngressSettings())) as client:
        answer = client.post("/v1/load_lora_adapter",
                             json={"lora_name": "qv", "lora_path": str(folders["root"] / "qv")})
        assert answer.status_code == 404 and "--runtime-lora-root" in answer.text
    engine.shutdown()


def test_an_engine_without_the_adapter_reads_it_from_the_request(
        folders: dict[str, Path]) -> None:
    """A replica started after a runtime load (or restarted) gets the adapter's folder with
    the request, reads it, then serves it: the same tokens as an engine that had it."""
    import asyncio

    from iterserve.replica.lora_adapter import LoRARequest

    config = EngineConfig.from_kwargs(model=str(folders["base"]), dtype="float32",
                                      enable_lora=True, max_lora_rank=8)
    engine = AsyncLLMEngine(config)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    lora = LoRARequest("late", str(folders["root"] / "qv"))

    async def run() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(PROMPT, greedy, "late-1", lora_request=lora):
            tokens.extend(out.new_token_ids)
        return tokens

    assert engine.list_loras() == []
    got = asyncio.run(run())
    assert engine.list_loras() == ["late"]
    engine.shutdown()
    offline = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_lora_rank=8,
                  lora_modules=f"qv={folders['root'] / 'qv'}")
    assert got == offline.generate([PROMPT], greedy, lora_name="qv")[0].outputs[0].token_ids



def test_a_replica_started_after_a_runtime_load_serves_the_adapter(
        folders: dict[str, Path]) -> None:
    """Scaling up after a load, narrowed to what a new replica depends on: the cluster's
    registry. The load reaches the engine running then; an engine started afterwards, which
    never saw it, then takes the request (pointing the ingress's client at it stands in for
    Serve routing to a replica the autoscaler added: a Serve scale-up does not fit a fast
    test here) and serves it with the same tokens, read from the folder the registry gave."""
    def engine() -> AsyncLLMEngine:
        return AsyncLLMEngine(EngineConfig.from_kwargs(
            model=str(folders["base"]), dtype="float32", enable_lora=True, max_lora_rank=8,
            runtime_lora_root=str(folders["root"])))

    running = engine()
    client = LocalEngineClient(running)
    with TestClient(create_app(client, IngressSettings())) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "late-mlp",
                                                          "lora_path": "mlp"})
        assert loaded.status_code == 200, loaded.text
        before = complete(http, "late-mlp")
        started_later = engine()
        client.engine = started_later  # the scale-up: the next request lands there
        assert started_later.list_loras() == []
        after = complete(http, "late-mlp")
        base = complete(http, http.get("/v1/models").json()["data"][0]["id"])
    running.shutdown()
    started_later.shutdown()
    assert before["status"] == after["status"] == 200
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["choices"][0]["text"] != base["choices"][0]["text"]
    assert started_later.list_loras() == ["late-mlp"]
