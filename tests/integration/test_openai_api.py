"""The OpenAI-compatible API end to end: official `openai` client -> Serve proxy ->
OpenAIIngress -> LLMReplica -> the real engine with the built-in tiny model (CPU).

One Serve application for the whole module (started once, ~15 s), bounded engine:
512-token context, 128 KV blocks, max_num_seqs 8, a waiting queue of 4 (so 429 is reachable),
a 64 KiB body limit and one API key.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import openai
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

API_KEY = "sk-iterserve-test-key"
BODY_LIMIT = 64 * 1024
MAX_MODEL_LEN = 512  # conftest SMALL_ENGINE


@pytest.fixture(scope="module")
def base_url(integration: Any) -> Any:
    assert integration.SMALL_ENGINE["max_model_len"] == MAX_MODEL_LEN
    app_args = {
        "engine_kwargs": {**integration.SMALL_ENGINE, "max_num_seqs": 8, "max_waiting_requests": 4},
        "api_keys": [API_KEY],
        "max_body_bytes": BODY_LIMIT,
        "num_gpus_per_replica": 0,  # CPU engine (SMALL_ENGINE) even on a GPU machine
    }
    with integration.serve_app(app_args) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def replica_infos(base_url: str, auth: dict[str, str]) -> list[dict[str, Any]]:
    response = httpx.get(f"{base_url}/debug/replicas", headers=auth, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def wait_engine_idle(base_url: str, auth: dict[str, str], timeout_s: float = 60
                     ) -> list[dict[str, Any]]:
    """Poll until every replica has no running/waiting request and no used KV block."""
    deadline = time.monotonic() + timeout_s
    stats: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        stats = [info["stats"] for info in replica_infos(base_url, auth)]
        if stats and all(s["num_running"] == 0 and s["num_waiting"] == 0
                         and s["num_free_blocks"] == s["num_total_blocks"]
                         and s["kv_usage"] == 0.0 for s in stats):
            return stats
        time.sleep(0.5)
    raise AssertionError(f"engine not idle after {timeout_s}s: {stats}")


# ------------------------------------------------------------------------------- happy paths


def test_models_list_reports_engine_config(client: openai.OpenAI, base_url: str,
                                           auth: dict[str, str]) -> None:
    models = client.models.list().data
    assert len(models) == 1
    card = httpx.get(f"{base_url}/v1/models", headers=auth).json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN
    meta = card["metadata"]
    assert meta["num_gpu_blocks_override"] == 128
    assert meta["max_num_seqs"] == 8 and meta["max_waiting_requests"] == 4
    # Resolved once, before the replicas started: no "auto" left, the model's own name.
    assert (meta["dtype"], meta["device"], meta["attention_backend"]) == ("float32", "cpu", "torch")
    assert meta["served_model_name"] == card["id"]
    for key in ("max_num_batched_tokens", "enable_chunked_prefill", "block_size",
                "scheduler_policy", "batching", "num_gpu_blocks"):
        assert key in meta
    # The ingress answers the card itself (no replica asked): the config it resolved is the
    # one the replica runs, value for value
    replica = replica_infos(base_url, auth)[0]
    assert {k: meta[k] for k in replica["config"]} == replica["config"]
    assert card["id"] == replica["model_name"]


def test_completion(client: openai.OpenAI, model: str, base_url: str,
                    auth: dict[str, str]) -> None:
    prompt = "The quick brown fox"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert isinstance(out.created, int) and out.model == model
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    count = httpx.post(f"{base_url}/tokenize", headers=auth, json={"prompt": prompt}).json()
    assert out.usage.prompt_tokens == count["count"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 12


def test_completion_token_id_prompts_batch(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 5


def test_chat_completion(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, max_tokens=10, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Say hello."}])
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.prompt_tokens > 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streaming_completion_with_usage(client: openai.OpenAI, model: str) -> None:
    args = {"model": model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**args)
    stream = client.completions.create(**args, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.id == chunks[0].id for c in chunks)


def test_streaming_chat_with_usage(client: openai.OpenAI, model: str) -> None:
    args = {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n2(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Numbers:", max_tokens=8, n=2,
                                    temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    chat = client.chat.completions.create(model=model, n=2, max_tokens=6, temperature=1.0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)
    assert 2 <= chat.usage.completion_tokens <= 12


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    args = {"model": model, "prompt": "def main():", "max_tokens": 24, "temperature": 0}
    text = client.completions.create(**args).choices[0].text
    stripped = text.strip()
    if len(stripped) < 6:
        pytest.skip(f"greedy output too short to pick a stop string: {text!r}")
    stop = stripped[len(stripped) // 2: len(stripped) // 2 + 2]
    stopped = client.completions.create(**args, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def test_seed_reproducible(client: openai.OpenAI, model: str) -> None:
    args = {"model": model, "prompt": "Random words:", "max_tokens": 12, "temperature": 1.0}
    first = client.completions.create(**args, seed=1234).choices[0].text
    again = client.completions.create(**args, seed=1234).choices[0].text
    assert first == again
    others = {client.completions.create(**args, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(others | {first}) > 1


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="a b c", max_tokens=5, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)  # the token + top-3 (vLLM)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "x"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_echo_scoring_and_cached_tokens(client: openai.OpenAI, model: str) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    out = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1,
                                    max_tokens=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == prompt and out.usage.completion_tokens == 0
    assert len(lp.tokens) == out.usage.prompt_tokens and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    client.completions.create(model=model, prompt=prompt, max_tokens=1)
    warm = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens >= 16
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=prompt, max_tokens=0)


def test_tokenize_detokenize(base_url: str, auth: dict[str, str]) -> None:
    ids = httpx.post(f"{base_url}/tokenize", headers=auth,
                     json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{base_url}/detokenize", headers=auth, json={"tokens": ids["tokens"]})
    assert text.json()["prompt"] == "hello world"


def test_health_and_metrics_are_open(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200
    metrics = httpx.get(f"{base_url}/metrics")
    assert metrics.status_code == 200 and "# TYPE" in metrics.text


# ------------------------------------------------------------------------------------ errors


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_401_missing_or_wrong_key(base_url: str, model: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers)
        error = _assert_openai_error(response, 401)
        assert API_KEY not in response.text and error["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_404_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


def test_400_prompt_too_long(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt=list(range(10, 10 + MAX_MODEL_LEN)),
                                  max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt="hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": "word " * MAX_MODEL_LEN}])


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "temperature": 5},
    {"prompt": "hi", "n": 100},
    {"prompt": "hi", "top_p": 0},
    {"prompt": "hi", "logprobs": 50},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "max_tokens": "many"},
    {"prompt": "hi", "stop": [""]},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": [1, -5]},
    {"prompt": [10**9]},
    {"prompt": "hi", "best_of": 3},
    {"prompt": "hi", "stream_options": {"include_usage": True}},
    {"prompt": "hi", "min_tokens": 10, "max_tokens": 2},
    {"prompt": "hi", "repetition_penalty": 0},
    {},
])
def test_400_bad_completion_params(base_url: str, auth: dict[str, str],
                                   body: dict[str, Any]) -> None:
    response = httpx.post(f"{base_url}/v1/completions", headers=auth, json=body, timeout=60)
    _assert_openai_error(response, 400)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": "hello"},
])
def test_400_bad_chat_params(base_url: str, auth: dict[str, str], body: dict[str, Any]) -> None:
    response = httpx.post(f"{base_url}/v1/chat/completions", headers=auth, json=body)
    _assert_openai_error(response, 400)


def test_400_malformed_json(base_url: str, auth: dict[str, str]) -> None:
    for raw in (b"{not json", b"", b"[1, 2]", b"null"):
        response = httpx.post(f"{base_url}/v1/completions", content=raw,
                              headers={**auth, "Content-Type": "application/json"})
        _assert_openai_error(response, 400)


def test_413_body_too_large(base_url: str, auth: dict[str, str]) -> None:
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1})
    response = httpx.post(f"{base_url}/v1/completions", content=big,
                          headers={**auth, "Content-Type": "application/json"})
    _assert_openai_error(response, 413)


async def _fire(base_url: str, auth: dict[str, str], model: str, count: int
                ) -> list[tuple[int, dict[str, str], str]]:
    """Open `count` long streams at once; return (status, headers, body head), then close."""
    limits = httpx.Limits(max_connections=count + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        body = {"model": model, "prompt": "Tell me everything.", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}

        async def one() -> tuple[int, dict[str, str], str]:
            request = http.build_request("POST", f"{base_url}/v1/completions", json=body,
                                         headers=auth)
            response = await http.send(request, stream=True)
            try:
                head = (await response.aread()).decode() if response.status_code != 200 else ""
                return response.status_code, dict(response.headers), head
            finally:
                await response.aclose()  # disconnect: the streams that got in are aborted

        return await asyncio.gather(*(one() for _ in range(count)))


def test_429_when_waiting_queue_full(base_url: str, auth: dict[str, str], model: str) -> None:
    results = asyncio.run(_fire(base_url, auth, model, 40))
    statuses = [status for status, _, _ in results]
    assert 200 in statuses and 429 in statuses, statuses
    assert 500 not in statuses
    for status, headers, head in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert json.loads(head)["error"]["type"] == "rate_limit_error"
    wait_engine_idle(base_url, auth)


def test_disconnects_free_every_block(base_url: str, auth: dict[str, str], model: str) -> None:
    """20 streams dropped at random points leave no running request and no used KV block."""
    rng = random.Random(0)

    async def drop_after(http: httpx.AsyncClient, num_lines: int) -> int:
        body = {"model": model, "max_tokens": 300, "temperature": 0.8, "seed": num_lines,
                "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Talk for a long time."}]}
        async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                               headers=auth) as response:
            assert response.status_code == 200, await response.aread()
            seen = 0
            async for line in response.aiter_lines():
                seen += bool(line.startswith("data: "))
                if seen >= num_lines:
                    break
        return seen

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:
            seen = []
            for _ in range(4):  # waves of 5 fit max_num_seqs + the waiting bound
                seen += await asyncio.gather(*(drop_after(http, rng.randint(1, 40))
                                               for _ in range(5)))
            return seen

    cancelled_before = sum(i["num_cancelled"] for i in replica_infos(base_url, auth))
    started = time.monotonic()
    seen = asyncio.run(run())
    assert len(seen) == 20
    stats = wait_engine_idle(base_url, auth)
    assert stats[0]["num_total_blocks"] == 128
    # The streams really were cut short (not finished before the client left) ...
    cancelled = sum(i["num_cancelled"] for i in replica_infos(base_url, auth))
    assert cancelled - cancelled_before == 20
    # ... and freeing took far less than generating 20 x 300 tokens would.
    assert time.monotonic() - started < 60
