"""response_format, vLLM's guided_* / structured_outputs, logit controls and tools over
HTTP: the ingress app (`create_app`) over the REAL AsyncLLMEngine with the tiny model, in
this process (no Ray; the live Serve path is tests/integration/test_structured_serve.py).
The tiny model uses Llama 3 special tokens, so tools use the shipped tool_llama3_json
template and the llama3_json parser."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.deploy.tool_calls import ToolSettings
from iterserve.replica import AsyncLLMEngine, EngineConfig

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig.from_kwargs(model="iterserve-tiny", device="cpu", max_model_len=1024,
                                      num_gpu_blocks_override=256, max_num_seqs=8)
    engine = AsyncLLMEngine(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def http(engine):
    settings = IngressSettings(tools=ToolSettings.from_flags("tool_llama3_json", "llama3_json"))
    with TestClient(create_app(LocalEngineClient(engine), settings)) as client:
        yield client


@pytest.fixture(scope="module")
def plain_http(engine):
    """The model's own template, which does not render tools."""
    with TestClient(create_app(LocalEngineClient(engine), IngressSettings())) as client:
        yield client


def chat(http: TestClient, **body: object) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": USER, **body})
    assert response.status_code == 200, response.text
    return response.json()


def bad(http: TestClient, path: str, body: dict, needle: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"], error


def test_json_schema_response_format_validates(http: TestClient) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                                "confidence": {"type": "integer", "minimum": 0,
                                                               "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    body = chat(http, max_tokens=64, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


def test_completions_take_guided_extras_and_structured_outputs(http: TestClient) -> None:
    def text(**extra: object) -> str:
        response = http.post("/v1/completions", json={"prompt": "Say", "max_tokens": 24,
                                                      "seed": 2, **extra})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    assert re.fullmatch(r"\d{3}-[a-z]{2}", text(guided_regex=r"\d{3}-[a-z]{2}"))
    assert text(guided_choice=["red", "green"]) in ("red", "green")
    assert text(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")
    assert re.fullmatch(r"(ab)+", text(guided_grammar='root ::= "ab" | "ab" root'))
    assert isinstance(json.loads(text(max_tokens=200, response_format={"type": "json_schema",
                      "json_schema": {"name": "n", "schema": {
                          "type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
                          "required": ["n"]}}})), dict)


@pytest.mark.parametrize(("body", "needle"), [
    ({"guided_regex": "(unclosed"}, "invalid regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "invalid grammar"),
    ({"guided_json": {"type": "frobnicate"}}, "invalid json schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format type"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "Only one"),
    ({"logit_bias": {"12": 101}}, "[-100, 100]"),
    ({"logit_bias": {"999999": 1}}, "vocabulary size"),
    ({"logit_bias": {"abc": 1}}, "token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_bad_constraints_are_400_before_routing(http: TestClient, body: dict,
                                                 needle: str) -> None:
    bad(http, "/v1/completions", {"prompt": "x", **body}, needle)


def test_logit_bias_over_http(http: TestClient) -> None:
    response = http.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "logit_bias": {"77": 100}, "logprobs": 0})
    assert response.status_code == 200, response.text
    tokens = http.post("/tokenize", json={"prompt": response.json()["choices"][0]["text"],
                                          "add_special_tokens": False}).json()["tokens"]
    assert set(tokens) == {77}


def test_tools_need_a_template_that_renders_them(plain_http: TestClient) -> None:
    bad(plain_http, "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER], "tool_choice": "auto"}, "cannot render tools")
    bad(plain_http, "/v1/chat/completions",
        {"messages": USER, "tool_choice": "required"}, "tool_choice needs tools")


@pytest.mark.parametrize("seed", range(6))
def test_required_always_yields_a_call_to_a_declared_tool(http: TestClient, seed: int) -> None:
    body = chat(http, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=256,
                temperature=1.0, seed=seed)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            declared[call["function"]["name"]])


def test_named_tool_choice_and_streamed_tool_call_deltas(http: TestClient) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    body = chat(http, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=64, seed=0)
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        CLOCK["function"]["parameters"])
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": USER, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": 128, "seed": 3, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    tool_deltas = [t for d in deltas for t in (d.get("tool_calls") or [])]
    assert tool_deltas and tool_deltas[0]["function"]["name"] == "get_weather"
    assert tool_deltas[0]["id"].startswith("call_") and tool_deltas[0]["index"] == 0
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_and_auto_answer_with_content(http: TestClient) -> None:
    for tool_choice in ("none", "auto"):
        body = chat(http, tools=[WEATHER], tool_choice=tool_choice, max_tokens=8,
                    temperature=0, ignore_eos=True)
        choice = body["choices"][0]
        # the random tiny model does not write calls: content, and no tool_calls
        assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "length"


def test_a_conversation_with_earlier_tool_calls_renders(http: TestClient) -> None:
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C and sunny"},
    ]
    response = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                       "max_tokens": 4})
    assert response.status_code == 200, response.text


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    temperature_c: int = pydantic.Field(ge=-50, le=50)
    sunny: bool


def test_openai_client_parse_helper_returns_the_pydantic_object(http: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                           max_retries=0)
    model = client.models.list().data[0].id
    completion = client.chat.completions.parse(model=model, messages=USER,
                                               response_format=Answer, max_tokens=128, seed=4)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer) and -50 <= parsed.temperature_c <= 50
