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
def hermes_http(engine):
    """The shipped ChatML template with Hermes-style <tool_call> tags (parser: hermes)."""
    settings = IngressSettings(tools=ToolSettings.from_flags("tool_chatml", "hermes"))
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


def completion_tokens(http: TestClient, **body: object) -> list[str]:
    """The completion's tokens, one display string each (from its logprobs)."""
    response = http.post("/v1/completions", json={"prompt": "x", "logprobs": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def token_strings(engine, ids: list[int]) -> list[str]:
    tokenizer = engine.engine.tokenizer
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_allowed_token_ids_over_http_on_both_routes(http: TestClient, engine) -> None:
    allowed = [101, 202, 303, 404]
    allowed_text = set(token_strings(engine, allowed))
    assert len(allowed_text) == len(allowed)  # distinct strings: membership is exact
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    free = completion_tokens(http, **sampling)
    assert not set(free) <= allowed_text  # the check below can fail
    tokens = completion_tokens(http, **sampling, allowed_token_ids=allowed)
    assert len(tokens) == 12 and set(tokens) <= allowed_text
    body = chat(http, **sampling, logprobs=True, allowed_token_ids=allowed)
    chat_tokens = [t["token"] for t in body["choices"][0]["logprobs"]["content"]]
    assert len(chat_tokens) == 12 and set(chat_tokens) <= allowed_text


def test_bad_words_over_http_ban_the_word_where_greedy_would_write_it(http: TestClient,
                                                                       engine) -> None:
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = completion_tokens(http, **greedy)
    # the first whole word greedy decoding writes after a few tokens: the one to ban
    position, word = next((i, t.strip()) for i, t in enumerate(free)
                          if i >= 2 and t.startswith(" ") and t.strip().isalpha())
    banned = completion_tokens(http, **greedy, bad_words=[word])
    assert banned[:position] == free[:position]  # the same text up to the word ...
    assert banned[position] != free[position]  # ... where another token is chosen
    tokenizer = engine.engine.tokenizer
    sequences = [token_strings(engine, tokenizer.encode(text, add_special_tokens=False))
                 for text in (word, " " + word)]
    for sequence in sequences:  # neither spelling of the word occurs in the output
        assert not any(banned[i:i + len(sequence)] == sequence for i in range(len(banned)))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_json_object_response_format_over_http(http: TestClient, route: str) -> None:
    """The tiny random model writes long keys: on completions some seeds finish (a JSON
    object), the rest run out of tokens inside one (finish_reason "length", a prefix of an
    object); on chat none finish in 64 tokens, so there the prefix is what is checked (a real
    model's finished chat objects: test_structured_builtin.py)."""
    def choice(seed: int, **body: object) -> tuple[str, str]:
        body.update({"prompt": "Give JSON"} if "chat" not in route else {"messages": USER})
        response = http.post(route, json={"max_tokens": 64, "seed": seed, **body})
        assert response.status_code == 200, response.text
        out = response.json()["choices"][0]
        return out["finish_reason"], out["text"] if "chat" not in route else out["message"]["content"]

    assert not choice(0)[1].startswith("{")  # unconstrained, the model writes no JSON
    finished = 0
    for seed in range(6):
        reason, text = choice(seed, response_format={"type": "json_object"})
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
            finished += 1
        else:
            assert reason == "length" and text.startswith('{"'), (reason, text)
    assert finished >= 1 or "chat" in route


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
        # the random tiny model does not write calls: content, and no tool_calls key (OpenAI)
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
        assert choice["message"]["content"]


# What a model that decides to call get_weather writes, in each template's format; the
# auto tests constrain the tiny random model to it (it writes no calls of its own).
LLAMA3_WEATHER_CALL = {"type": "object", "properties": {
    "name": {"enum": ["get_weather"]}, "parameters": WEATHER["function"]["parameters"]},
    "required": ["name", "parameters"], "additionalProperties": False}
HERMES_WEATHER_CALL = (r'Checking the weather\. <tool_call>\{"name": "get_weather", '
                       r'"arguments": \{"city": "[A-Z][a-z]{1,7}", "unit": "(c|f)"\}\}</tool_call>')


def check_weather_call(call: dict) -> None:
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])


def test_auto_extracts_a_llama3_json_call_from_the_output(http: TestClient) -> None:
    body = chat(http, tools=[WEATHER, CLOCK], tool_choice="auto", max_tokens=96, seed=0,
                guided_json=LLAMA3_WEATHER_CALL)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
    check_weather_call(choice["message"]["tool_calls"][0])


def test_auto_extracts_a_hermes_call_after_content(hermes_http: TestClient) -> None:
    choice = chat(hermes_http, tools=[WEATHER, CLOCK], tool_choice="auto", max_tokens=96,
                  seed=1, guided_regex=HERMES_WEATHER_CALL)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] == "Checking the weather."
    (call,) = choice["message"]["tool_calls"]
    check_weather_call(call)


def test_auto_streams_content_then_the_call_as_tool_call_deltas(hermes_http: TestClient) -> None:
    with hermes_http.stream("POST", "/v1/chat/completions", json={
            "messages": USER, "tools": [WEATHER, CLOCK], "tool_choice": "auto", "seed": 1,
            "max_tokens": 96, "stream": True, "guided_regex": HERMES_WEATHER_CALL}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking the weather. "  # sent before the call began, and only that
    tool_deltas = [t for d in deltas for t in (d.get("tool_calls") or [])]
    assert len(tool_deltas) == 1 and tool_deltas[0]["index"] == 0
    check_weather_call(tool_deltas[0])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_openai_client_reads_auto_answers_with_and_without_a_call(http: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                           max_retries=0)
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=USER, tools=[WEATHER],
                                           tool_choice="auto", max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    called = client.chat.completions.create(
        model=model, messages=USER, tools=[WEATHER, CLOCK], tool_choice="auto", max_tokens=96,
        seed=0, extra_body={"guided_json": LLAMA3_WEATHER_CALL})
    (call,) = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


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
