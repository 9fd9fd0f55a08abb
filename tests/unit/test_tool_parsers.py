"""Tool-call parsers, streaming hold-back, the forced-call schema and the shipped templates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from iterserve.deploy.schemas import ChatCompletionRequest
from iterserve.deploy.tool_calls import (
    ToolCallStream,
    ToolOutputParser,
    ToolSettings,
    forced_tool_spec,
    load_chat_template,
    template_renders_tools,
)
from iterserve.deploy.tool_parsers import HermesToolParser, Llama3JsonToolParser, tool_parser
from iterserve.replica.tokenizer import compile_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def request(**kwargs: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 tools=[WEATHER, TIME], **kwargs)


def test_hermes_parses_calls_and_leading_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    parsed = HermesToolParser().parse(text)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    "no calls here",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
])
def test_hermes_leaves_unparseable_text_as_content(text: str) -> None:
    parsed = HermesToolParser().parse(text)
    assert parsed.content == text and parsed.tool_calls == []


def test_llama3_json_parses_one_or_several_calls() -> None:
    parser = Llama3JsonToolParser()
    one = parser.parse('{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert one.content is None and one.tool_calls[0].name == "get_weather"
    two = parser.parse('<|python_tag|>{"name": "get_time", "parameters": {}}; '
                       '{"name": "get_weather", "parameters": {"city": "Lima"}}')
    assert [c.name for c in two.tool_calls] == ["get_time", "get_weather"]
    assert parser.parse("Hello {there}").tool_calls == []
    assert parser.parse('{"name": "x", "parameters": [1]}').tool_calls == []


def test_hold_from_keeps_back_a_possible_call_start() -> None:
    hermes = HermesToolParser()
    assert hermes.hold_from("Sure <tool") == len("Sure ")
    assert hermes.hold_from("Sure <tool_call>{") == len("Sure ")
    assert hermes.hold_from("Sure thing") == len("Sure thing")
    llama = Llama3JsonToolParser()
    assert llama.hold_from("  {") == 0 and llama.hold_from("<|py") == 0
    assert llama.hold_from("Hello") == 5


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_parser("nope")
    with pytest.raises(ValueError):
        ToolSettings(tool_call_parser="nope")


def test_required_schema_accepts_exactly_calls_to_declared_tools() -> None:
    spec = forced_tool_spec(request(tool_choice="required"))
    schema = json.loads(spec.text)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "launch", "arguments": {}}], [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(forced_tool_spec(request(tool_choice="required",
                                                 parallel_tool_calls=False)).text)
    assert single["maxItems"] == 1


def test_named_choice_is_constrained_to_its_parameters() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec = forced_tool_spec(request(tool_choice=named))
    assert json.loads(spec.text) == WEATHER["function"]["parameters"]
    reader = ToolOutputParser.for_request(request(tool_choice=named), ToolSettings())
    parsed = reader.parse('{"city": "Paris"}')
    assert parsed.tool_calls[0].name == "get_weather" and parsed.content is None
    assert forced_tool_spec(request(tool_choice="auto")) is None


def test_stream_sends_content_until_a_call_then_the_call_at_the_end() -> None:
    stream = ToolCallStream(ToolOutputParser.for_request(request(tool_choice="auto"),
                                                         ToolSettings()))
    pieces = ["Checking", " now <to", 'ol_call>{"name": "get_time", ', '"arguments": {}}',
              "</tool_call>"]
    sent = "".join(stream.content_delta(p) for p in pieces)
    assert sent == "Checking now "
    rest, deltas, parsed = stream.finish()
    assert rest == "" and deltas[0].function.name == "get_time"
    assert deltas[0].id.startswith("call_") and deltas[0].index == 0
    plain = ToolCallStream(ToolOutputParser.for_request(request(tool_choice="auto"),
                                                        ToolSettings()))
    assert plain.content_delta("a <tool_c") == "a "
    assert plain.finish()[0] == "<tool_c"  # no call after all: the held text is content


@pytest.mark.parametrize("name", ["tool_chatml", "tool_llama3_json"])
def test_shipped_templates_render_tools_and_tool_turns(name: str) -> None:
    source = load_chat_template(name)
    assert template_renders_tools(source)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = compile_chat_template(source).render(messages=messages, tools=[WEATHER],
                                                add_generation_prompt=True,
                                                bos_token="<s>", eos_token="</s>")
    assert "get_weather" in text and "Weather in a city" in text and "sunny" in text
    assert '"city": "Oslo"' in text


def test_unknown_template_name_is_refused() -> None:
    with pytest.raises(ValueError, match="shipped template"):
        load_chat_template("does-not-exist")
