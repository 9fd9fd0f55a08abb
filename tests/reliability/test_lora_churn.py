"""LoRA adapters loaded and unloaded over HTTP while requests for them stream: nothing is lost.

uvicorn on 127.0.0.1 serving the production app (`create_app`) over the real in-process
engine (the built-in tiny model, fp32, 2 device slots and a host LRU of 2 for 3 adapter
folders, so slots and host memory turn over). Rounds overlap: each loads a new adapter name
while the previous round's streams still run, streams requests for it (and for the base
model) and asks to unload it while they run: the unload waits for them (deploy/lora_adapters.py)
and answers 200 once they ended, while the next round loads and streams. Every request that
the server took is completed in full with exactly the tokens its adapter gives alone (no row
read another adapter's slot);
requests naming an adapter not loaded get OpenAI's 404; afterwards every KV block is back
and every engine table empty.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_support import local_server, run_async

from iterserve.replica.make_model import default_model_path
from tests.unit.lora_testlib import make_adapter

pytestmark = pytest.mark.timeout(300)

PROMPT = [11, 42, 97, 300, 5, 8, 13]
MAX_TOKENS = 16
NUM_ROUNDS = 4
STREAMS_PER_ROUND = 4
FOLDERS = ("qv", "mlp", "all")


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora_churn")
    base = default_model_path()
    make_adapter(base, root / "qv", ["q_proj", "v_proj"], seed=1)
    make_adapter(base, root / "mlp", ["gate_proj", "up_proj", "down_proj"], seed=2)
    make_adapter(base, root / "all", ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
                 seed=3)
    return root


def engine_kwargs(root: Path) -> dict[str, Any]:
    return {"model": str(default_model_path()), "device": "cpu", "dtype": "float32",
            "max_model_len": 256, "num_gpu_blocks_override": 96,
            "max_num_batched_tokens": 128, "max_num_seqs": 8, "enable_lora": True,
            "max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 8,
            "runtime_lora_root": str(root)}


async def stream(http: httpx.AsyncClient, model: str,
                 started: asyncio.Event | None = None) -> dict[str, Any]:
    """One streamed greedy completion: its status, text, usage and whether it ended."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"model": model, "status": response.status_code,
                    "error": json.loads(await response.aread())["error"]}
        text, usage, done, errors = "", None, False, []
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:  # a request failed mid-stream: lost
                errors.append(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                text += choice.get("text", "")
                if started is not None and choice.get("text"):
                    started.set()
    return {"model": model, "status": 200, "text": text, "usage": usage, "done": done,
            "errors": errors}


async def post(http: httpx.AsyncClient, path: str, body: dict[str, str]) -> int:
    return (await http.post(path, json=body)).status_code


async def churn(base_url: str, base_model: str) -> dict[str, Any]:
    """The overlapping rounds; returns every request's result and every unload's status."""
    results: list[dict[str, Any]] = []
    unloads: dict[str, list[int]] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        previous: tuple[str, list[asyncio.Task[dict[str, Any]]], asyncio.Task[int]] | None = None
        for round_no in range(NUM_ROUNDS):
            name, folder = f"churn-{round_no}", FOLDERS[round_no % len(FOLDERS)]
            assert await post(http, "/v1/load_lora_adapter",
                              {"lora_name": name, "lora_path": folder}) == 200
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream(http, name, started))
                     for _ in range(STREAMS_PER_ROUND)]
            tasks.append(asyncio.create_task(stream(http, base_model)))
            await asyncio.wait_for(started.wait(), 60)
            # in flight: the unload waits for the streams, which go on
            unload = asyncio.create_task(post(http, "/v1/unload_lora_adapter",
                                              {"lora_name": name}))
            if previous is not None:
                results += await finish_round(*previous, unloads)
            previous = (name, tasks, unload)
        assert previous is not None
        results += await finish_round(*previous, unloads)
        # gone: a request naming it is OpenAI's 404, not a stream
        results.append(await stream(http, previous[0]))
    return {"results": results, "unloads": unloads}


async def finish_round(name: str, tasks: list[asyncio.Task[dict[str, Any]]],
                       unload: asyncio.Task[int],
                       unloads: dict[str, list[int]]) -> list[dict[str, Any]]:
    done = list(await asyncio.gather(*tasks))
    unloads[name] = [await unload]
    return done


def test_adapters_load_and_unload_while_requests_stream_and_nothing_is_lost(
        adapter_root: Path) -> None:
    with local_server(engine_kwargs(adapter_root)) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            base_model = http.get("/v1/models").json()["data"][0]["id"]
            alone = {}  # each folder's tokens, served alone before the churn
            for folder in FOLDERS:
                http.post("/v1/load_lora_adapter", json={"lora_name": f"ref-{folder}",
                                                         "lora_path": folder})
                alone[folder] = run_async(stream_once(server.base_url, f"ref-{folder}"), 60)
                assert http.post("/v1/unload_lora_adapter",
                                 json={"lora_name": f"ref-{folder}"}).status_code == 200
            alone["base"] = run_async(stream_once(server.base_url, base_model), 60)
        out = run_async(churn(server.base_url, base_model), timeout_s=240)
        state = server.wait_idle(timeout_s=60)
        registered = server.engine_call(lambda engine: engine.list_loras())

    served, gone = out["results"][:-1], out["results"][-1]
    assert len(served) == NUM_ROUNDS * (STREAMS_PER_ROUND + 1)
    assert len(set(alone.values())) == len(alone)  # the adapters change the tokens
    for result in served:
        round_no = None if result["model"] == base_model else int(result["model"].split("-")[1])
        want = alone["base" if round_no is None else FOLDERS[round_no % len(FOLDERS)]]
        assert result["status"] == 200 and result["done"] and not result["errors"], result
        assert result["usage"] and result["usage"]["completion_tokens"] == MAX_TOKENS, result
        assert result["text"] == want, result  # its own adapter's tokens, nobody else's
    assert all(codes == [200] for codes in out["unloads"].values()), out["unloads"]
    assert gone["status"] == 404 and gone["model"] in gone["error"]["message"]
    assert state["num_free_blocks"] == state["num_total_blocks"]  # every KV block back
    assert registered == []  # every runtime adapter unloaded from the engine


async def stream_once(base_url: str, model: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        result = await stream(http, model)
    assert result["status"] == 200 and result["done"], result
    return str(result["text"])
