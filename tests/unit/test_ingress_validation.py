"""The ingress's FastAPI app without Ray: validation, auth, limits and error mapping.

The app is the same `create_app` the Serve ingress builds, over `LocalEngineClient`, which
wraps the REAL AsyncLLMEngine with the built-in tiny model in this process (no stand-in
engine), so the 400/404/413/429 paths run against real tokenization, real context-length
checks and the real engine's QueueFullError. Ray Serve itself is covered by
tests/integration/test_openai_api.py.

The engine is static-batching with max_num_seqs=1 and max_waiting_requests=1, so a full
waiting queue (429) can be produced deterministically.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.errors import engine_error_info, http_error_for
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.replica import AsyncLLMEngine, EngineConfig, SamplingParams
from iterserve.replica.errors import EngineDeadError, EngineDrainingError, QueueFullError

KEY = "sk-unit-test"
LIMIT = 4096
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig.from_kwargs(model="iterserve-tiny", device="cpu",
                                      max_model_len=MAX_MODEL_LEN,
                                      num_gpu_blocks_override=64, max_num_seqs=1,
                                      batching="static", max_waiting_requests=1)
    engine = AsyncLLMEngine(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    from pydantic import SecretStr

    settings = IngressSettings(api_keys=(SecretStr(KEY),), max_body_bytes=LIMIT)
    return create_app(LocalEngineClient(engine), settings)


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def _error(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_happy_completion_and_chat(http):
    out = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] <= 3
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"


def test_auth(app, http):
    with TestClient(app) as anonymous:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": "Bearer"}):
            response = anonymous.get("/v1/models", headers=headers)
            error = _error(response, 401)
            assert error["type"] == "authentication_error" and KEY not in response.text
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        assert anonymous.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert http.get("/v1/models").status_code == 200


def test_unknown_model_is_404(http):
    error = _error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    _error(http.get("/v1/models/gpt-9"), 404)


def test_prompt_too_long_is_400(http):
    error = _error(http.post("/v1/completions", json={"prompt": list(range(1, MAX_MODEL_LEN + 1))}),
                   400)
    assert "maximum context length" in error["message"] and error["param"] == "prompt"
    error = _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": MAX_MODEL_LEN}),
                   400)
    assert error["param"] == "max_tokens"


@pytest.mark.parametrize("raw", [b"{", b"", b"   ", b"[]", b'"text"', b"\xff\xfe"])
def test_malformed_bodies_are_400(http, raw):
    _error(http.post("/v1/chat/completions", content=raw,
                     headers={"Content-Type": "application/json"}), 400)


def test_validation_errors_are_400_never_500(http):
    for body in ({"prompt": "x", "temperature": "hot"}, {"prompt": "x", "n": 17},
                 {"messages": [{"role": "user"}], "top_logprobs": 3},
                 {"prompt": [1, 99999]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        _error(http.post(path, json=body), 400)


# Every bounded integer of issue 10, one step past its documented range, on both routes that
# take it: a 400 whose `param` names the field (pydantic's location, as the error mapper gives).
COMPLETION, CHAT = "/v1/completions", "/v1/chat/completions"
OUT_OF_RANGE = [
    (COMPLETION, "seed", 2**63), (COMPLETION, "seed", -(2**63) - 1), (CHAT, "seed", 2**64),
    (COMPLETION, "n", 0), (COMPLETION, "n", 2**31), (CHAT, "n", -1),
    (COMPLETION, "best_of", 0), (COMPLETION, "best_of", 10**30),
    (COMPLETION, "max_tokens", -1), (COMPLETION, "max_tokens", 2**31), (CHAT, "max_tokens", 0),
    (CHAT, "max_completion_tokens", 2**53 + 1), (CHAT, "max_completion_tokens", 0),
    (COMPLETION, "min_tokens", -1), (CHAT, "min_tokens", 2**31),
    (COMPLETION, "logprobs", -1), (COMPLETION, "logprobs", 2**31),
    (CHAT, "top_logprobs", -1), (CHAT, "top_logprobs", 2**63),
    (COMPLETION, "top_k", -2), (CHAT, "top_k", 2**31),
    (COMPLETION, "priority", 2**31), (CHAT, "priority", -(2**31) - 1),
    (COMPLETION, "prompt_logprobs", -1), (CHAT, "prompt_logprobs", 10**30),
    (COMPLETION, "stop_token_ids", [2**31]), (CHAT, "stop_token_ids", [-1]),
    (COMPLETION, "prompt", [1, 2**31]), (COMPLETION, "prompt", [-1]),
    (COMPLETION, "logit_bias", {"5": 101}), (CHAT, "logit_bias", {"5": -100.5}),
    (CHAT, "logit_bias", {str(2**31): 1}), (COMPLETION, "logit_bias", {"-1": 1}),
]


@pytest.mark.parametrize(("path", "field", "value"), OUT_OF_RANGE,
                         ids=[f"{p.split('/')[-1]}-{f}-{v}" for p, f, v in OUT_OF_RANGE])
def test_every_bounded_integer_is_a_400_naming_its_field(http, path, field, value):
    body = {"prompt": "hi"} if path == COMPLETION else {
        "messages": [{"role": "user", "content": "hi"}]}
    body[field] = value
    error = _error(http.post(path, json=body), 400)
    assert error["param"] is not None and error["param"].split(".")[0] == field, error


def test_body_limit_is_413_before_parsing(http):
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    _error(http.post("/v1/completions", content=big,
                     headers={"Content-Type": "application/json"}), 413)

    def chunks():  # no Content-Length: the streamed size is checked too
        for _ in range(8):
            yield b"x" * 1024

    _error(http.post("/v1/completions", content=chunks(),
                     headers={"Content-Type": "application/json"}), 413)


def test_unknown_route_and_method_are_openai_shaped(http):
    _error(http.get("/v2/nothing"), 404)
    _error(http.get("/v1/completions"), 405)


def test_tokenize_applies_chat_template(http, engine):
    messages = [{"role": "user", "content": "hello"}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == engine.tokenizer.encode(text, add_special_tokens=False)
    back = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == text


def test_queue_full_is_429_with_retry_after(app, engine):
    """One request runs, one waits (static batching, bound 1): the next HTTP call gets 429."""
    ids = engine.tokenizer.encode("hog")
    hog = SamplingParams(max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True, temperature=0)

    async def scenario():
        running = engine.generate(ids, hog, "hog-running")
        await running.__anext__()
        waiting = engine.generate(ids, hog, "hog-waiting")
        waiter = asyncio.create_task(waiting.__anext__())
        deadline = time.monotonic() + 10
        while engine.stats().num_waiting < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            plain = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            stream = await client.post("/v1/completions",
                                       json={"prompt": "x", "max_tokens": 2, "stream": True})
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await waiting.aclose()
        await running.aclose()
        return plain, stream

    for response in asyncio.run(scenario()):
        error = _error(response, 429)  # streams too: decided before the first SSE byte
        assert error["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            break
        time.sleep(0.05)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_engine_error_mapping():
    assert engine_error_info(QueueFullError(5, retry_after_s=2.5)).to_http().headers == {
        "Retry-After": "3"}
    assert engine_error_info(EngineDrainingError("bye")).status_code == 503
    assert engine_error_info(EngineDeadError("x")).status_code == 500
    assert engine_error_info(ValueError("bad")).status_code == 400
    assert engine_error_info(RuntimeError("bug")) is None
    assert http_error_for(RuntimeError("secret detail")).message == "Internal server error."

    class RayTaskErrorLike(Exception):  # Ray keeps the user exception in `.cause`
        cause = QueueFullError(1)

    assert http_error_for(RayTaskErrorLike()).status_code == 429


def test_echo_and_sse_framing(http):
    out = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 3,
                                             "temperature": 0, "echo": True}).json()
    plain = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 3,
                                               "temperature": 0}).json()
    assert out["choices"][0]["text"] == "hello there" + plain["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={
            "prompt": "hello there", "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        plain["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
