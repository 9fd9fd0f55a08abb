"""The ingress's side of a drain, over real HTTP without Ray (deploy/lifecycle.py).

The app is `create_app` over `LocalEngineClient` and the REAL tiny engine, served by uvicorn
on a free port, so streams are streamed: a request admitted before the drain runs to its
end while new ones get a 503 with Retry-After, /health says "draining" and /live and
/metrics still answer; `AsyncLLMEngine.end_requests` (the drain timeout) ends a live stream
with an in-band 503 error and frees its blocks. tests/integration/test_serve_signals.py runs
the whole drain through `iterserve serve` and Ray.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.lifecycle import ServingState
from iterserve.deploy.server import create_app
from iterserve.loadtests.servers import free_port
from iterserve.replica import AsyncLLMEngine, EngineConfig


@dataclass
class Served:
    url: str
    engine: AsyncLLMEngine
    state: ServingState


@pytest.fixture()
def served() -> Iterator[Served]:
    config = EngineConfig.from_kwargs(model="iterserve-tiny", device="cpu", max_model_len=512,
                                      num_gpu_blocks_override=64)
    engine = AsyncLLMEngine(config)
    state = ServingState()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(LocalEngineClient(engine), state=state),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield Served(f"http://127.0.0.1:{port}", engine, state)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()


def _stream(url: str, max_tokens: int) -> Iterator[str]:
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield line.removeprefix("data: ")


def test_a_drain_refuses_new_requests_and_lets_admitted_ones_finish(served: Served) -> None:
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    events = _stream(served.url, max_tokens=64)
    first = json.loads(next(events))
    assert first["choices"][0]["text"] is not None
    assert served.state.in_flight == 1
    assert served.state.begin_drain() == 1

    refused = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(f"{served.url}/v1/models").status_code == 503
    health = httpx.get(f"{served.url}/health")
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    live = httpx.get(f"{served.url}/live")
    assert (live.status_code, live.json()) == (200, {"status": "draining"})
    assert httpx.get(f"{served.url}/metrics").status_code == 200

    rest = list(events)
    assert rest[-1] == "[DONE]"
    tokens = 1 + sum(1 for e in rest[:-1] if json.loads(e)["choices"])
    assert tokens >= 32  # the admitted stream was not cut (deltas may batch tokens)
    assert all("error" not in json.loads(e) for e in rest[:-1])
    deadline = time.monotonic() + 5  # counted until the app returns, just after [DONE]
    while served.state.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_end_requests_ends_a_live_stream_with_an_error_and_frees_its_blocks(
        served: Served) -> None:
    events = _stream(served.url, max_tokens=480)
    next(events)
    assert served.engine.stats().num_running == 1
    assert asyncio.run(served.engine.end_requests("the drain timeout ended it")) == 1
    rest = list(events)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "service_unavailable"
    assert error["message"] == "the drain timeout ended it"
    deadline = time.monotonic() + 10
    while served.engine.stats().num_free_blocks != served.engine.stats().num_total_blocks:
        assert time.monotonic() < deadline, served.engine.stats()
        time.sleep(0.05)
    assert served.engine.is_draining
    refused = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503
