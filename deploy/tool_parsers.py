"""Tool-call parsers: find the calls in a model's text, in the format its template asked for.

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen 2.5+)
    llama3_json   {"name": ..., "parameters": {...}}; several separated by ';'  (Llama 3.x)

As vLLM's parsers do, a call whose JSON does not parse leaves the whole text as content.
`hold_from` tells a streaming response where text must stop being sent as content because
it may be the start of a tool call (the rest waits for the end of the output).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    name: ClassVar[str]

    def parse(self, text: str) -> ParsedOutput: ...

    def hold_from(self, text: str) -> int: ...


def _call_from(obj: Any) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode; keep it if it is JSON
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _prefix_overlap(text: str, marker: str) -> int:
    """Start of the longest suffix of text that is a proper prefix of marker, else len."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class HermesToolParser:
    name: ClassVar[str] = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for body in self.CALL.findall(text[start:]):
            try:
                call = _call_from(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start].strip() or None, calls)

    def hold_from(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else _prefix_overlap(text, self.START)


class Llama3JsonToolParser:
    name: ClassVar[str] = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedOutput(text)
            call = _call_from(obj)
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\n;":
                position += 1
        return ParsedOutput(None, calls)

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        tag = self.PYTHON_TAG
        if not stripped or stripped.startswith(("{", tag)) or tag.startswith(stripped):
            return 0  # may still become a call: send nothing yet
        return len(text)

TOOL_PARSERS: dict[str, type] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
# vLLM's names for the same formats.
TOOL_PARSERS.update({"qwen": HermesToolParser, "llama3": Llama3JsonToolParser})


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{sorted(TOOL_PARSERS)}") from None
