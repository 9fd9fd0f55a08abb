"""echo / max_tokens 0 / prompt_logprobs / cached_tokens through the HTTP API, without Ray.

The official `openai` client talks to the ingress's FastAPI app (`create_app`) through
Starlette's TestClient (an httpx.Client), over `LocalEngineClient` wrapping the REAL
AsyncLLMEngine with a tiny random checkpoint in fp32; HF transformers scores the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.replica import AsyncLLMEngine, EngineConfig
from iterserve.replica.make_model import write_model

transformers = pytest.importorskip("transformers")

PROMPT_IDS = [11, 400, 52, 1999, 7, 318, 2048, 64, 9, 100, 777, 23, 5, 1500, 42, 3000, 8, 61,
              250, 99]  # 20 tokens: one full block of 16 to hit in the prefix cache


MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("api-lp"), seed=9)


@pytest.fixture(scope="module")
def http(checkpoint: Path):
    config = EngineConfig.from_kwargs(model=str(checkpoint), device="cpu", dtype="float32",
                                      max_model_len=256, num_gpu_blocks_override=64,
                                      served_model_name=MODEL,
                                      block_size=16, max_num_batched_tokens=8)
    engine = AsyncLLMEngine(config)
    app = create_app(LocalEngineClient(engine), IngressSettings())
    with TestClient(app) as client:
        yield client
    engine.shutdown()


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                         max_retries=0)


@pytest.fixture(scope="module")
def hf_row_logprobs(checkpoint: Path) -> torch.Tensor:
    """[len - 1, V]: HF's log-probabilities for PROMPT_IDS positions 1.."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def expected_token_logprobs(rows: torch.Tensor) -> list[float]:
    return [float(rows[i, PROMPT_IDS[i + 1]]) for i in range(len(PROMPT_IDS) - 1)]


def test_openai_client_parses_echo_scoring_only(client: openai.OpenAI,
                                                hf_row_logprobs: torch.Tensor) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, logprobs=1,
                                    max_tokens=0, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(PROMPT_IDS)  # the prompt only
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected_token_logprobs(hf_row_logprobs),
                                                  abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # the token + top-1
    assert lp.text_offset[0] == 0 and choice.text == "".join(lp.tokens)
    assert out.usage.prompt_tokens == len(PROMPT_IDS) and out.usage.completion_tokens == 0
    assert choice.finish_reason == "length"


def test_echo_with_generation_puts_the_prompt_first(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, logprobs=2,
                                    max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 3 and out.usage.completion_tokens == 3
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    plain = client.completions.create(model=MODEL, prompt=PROMPT_IDS, logprobs=2,
                                      max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert lp.tokens[-3:] == plain.choices[0].logprobs.tokens
    assert out.choices[0].text.endswith(plain.choices[0].text)
    text_prompt = client.completions.create(model=MODEL, prompt="hello world", echo=True,
                                            max_tokens=2, temperature=0)
    assert text_prompt.choices[0].text.startswith("hello world")  # echoed as sent


def test_max_tokens_zero_without_echo_is_400(http: TestClient) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400, response.text
    assert "echo" in response.json()["error"]["message"]


def test_vllm_prompt_logprobs_extra(http: TestClient, hf_row_logprobs: torch.Tensor) -> None:
    body = http.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 1,
                                               "prompt_logprobs": 2}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(PROMPT_IDS) and scored[0] is None
    first = scored[1]
    assert list(first)[0] == str(PROMPT_IDS[1])  # the prompt token, then the top-2
    assert 2 <= len(first) <= 3
    row = hf_row_logprobs[0]
    entry = first[str(PROMPT_IDS[1])]
    assert entry["logprob"] == pytest.approx(float(row[PROMPT_IDS[1]]), abs=1e-4)
    assert entry["rank"] == int((row >= row[PROMPT_IDS[1]]).sum())
    assert isinstance(entry["decoded_token"], str)
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in chat["choices"][0]


def test_streaming_echo_sends_the_prompt_first(http: TestClient) -> None:
    with http.stream("POST", "/v1/completions", json={
            "prompt": PROMPT_IDS, "echo": True, "logprobs": 1, "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]["choices"][0]["logprobs"]
    assert len(first["tokens"]) == len(PROMPT_IDS) + 1  # the prompt, then the first token
    assert first["token_logprobs"][0] is None and first["text_offset"][0] == 0
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["choices"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert len(tokens) == len(PROMPT_IDS) + 3
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 3 and "cached_tokens" in usage["prompt_tokens_details"]


def test_cached_tokens_in_usage(client: openai.OpenAI, http: TestClient) -> None:
    prompt = [p + 1 for p in PROMPT_IDS]  # not seen by the other tests
    cold = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    warm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == 16  # one full block
    scoring = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                        logprobs=0)
    assert scoring.usage.prompt_tokens_details.cached_tokens == 0  # computes every position
    messages = [{"role": "user", "content": "the same conversation, asked twice " * 3}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                            stream=True, stream_options={"include_usage": True})
    final = [c for c in stream][-1]
    assert final.usage.prompt_tokens_details.cached_tokens > 0
