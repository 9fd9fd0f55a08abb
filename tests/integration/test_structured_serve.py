"""Structured outputs and tools through the live stack: the official `openai` client ->
Serve proxy -> OpenAIIngress (validation, chat template with tools, tool parser) ->
LLMReplica -> the real engine (tiny model, CPU) with xgrammar in the replica process.

Run under the shared lock: flock /tmp/iterserve-heavy.lock .venv/bin/python -m pytest ...
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

LOOKUP = {"type": "function", "function": {
    "name": "lookup_order", "description": "Find an order",
    "parameters": {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "priority": {"enum": ["low", "high"]}},
        "required": ["order_id", "priority"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "Where is my order?"}]


class Order(pydantic.BaseModel):
    order_id: int = pydantic.Field(ge=1, le=9999)
    status: str = pydantic.Field(max_length=12)
    shipped: bool


@pytest.fixture(scope="module")
def client(integration: Any) -> openai.OpenAI:
    app_args = {
        "engine_kwargs": {**integration.SMALL_ENGINE, "max_model_len": 1024,
                          "max_num_batched_tokens": 1024},
        "num_gpus_per_replica": 0,
        # the tiny model's template is Llama 3 style without tools: ship one that has them
        "chat_template": "tool_llama3_json",
        "tool_call_parser": "llama3_json",
    }
    with integration.serve_app(app_args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_parse_helper_returns_the_pydantic_object(client: openai.OpenAI, model: str) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(model=model, messages=USER,
                                                   response_format=Order, max_tokens=200,
                                                   seed=seed)
        assert isinstance(completion.choices[0].message.parsed, Order)


def test_required_tool_call_parses_every_time(client: openai.OpenAI, model: str) -> None:
    for seed in range(4):
        response = client.chat.completions.create(model=model, messages=USER, tools=[LOOKUP],
                                                  tool_choice="required", max_tokens=200,
                                                  seed=seed, temperature=1.0)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "lookup_order" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments),
                            LOOKUP["function"]["parameters"])


def test_streamed_named_tool_call(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=USER, tools=[LOOKUP], max_tokens=200, seed=5, stream=True,
        tool_choice={"type": "function", "function": {"name": "lookup_order"}})
    chunks = list(stream)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or []) if c.choices]
    arguments = "".join(t.function.arguments or "" for t in calls)
    assert calls[0].function.name == "lookup_order"
    jsonschema.validate(json.loads(arguments), LOOKUP["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_invalid_schema_is_400_and_the_server_stays_healthy(client: openai.OpenAI,
                                                             model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="invalid"):
        client.chat.completions.create(model=model, messages=USER, max_tokens=8,
                                       extra_body={"guided_regex": "(oops"})
    ok = client.chat.completions.create(model=model, messages=USER, max_tokens=8,
                                        extra_body={"guided_choice": ["fine", "great"]})
    assert ok.choices[0].message.content in ("fine", "great")
