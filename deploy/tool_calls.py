"""tools and tool_choice: the prompt, the constraint and the calls in the response.

    "none"        tools are not rendered; the answer is plain content
    "auto"        the chat template renders the tools; the tool parser finds calls in the text
    "required"    decoding is constrained to a JSON array of calls to declared tools
    named         decoding is constrained to that function's parameters (the arguments)

With "required" and a named function the output always parses: the grammar allows nothing
else (vLLM's approach). Tool settings are the ingress's: `--chat-template` (a shipped name
from deploy/templates/ or a file) and `--tool-call-parser`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iterserve.deploy.errors import bad_request
from iterserve.deploy.schemas import (
    ChatCompletionRequest,
    ToolCall,
    ToolCallFunction,
)
from iterserve.deploy.schemas_chat import (
    DeltaFunctionCall,
    DeltaToolCall,
)
from iterserve.deploy.tool_parsers import ParsedOutput, ParsedToolCall, ToolParser, tool_parser
from iterserve.replica.structured_spec import StructuredSpec

TEMPLATES = Path(__file__).parent / "templates"
DEFAULT_TOOL_PARSER = "hermes"
BUILTIN_MODEL_TOOL_TEMPLATE = "tool_chatml"  # the built-in SmolLM2 is a ChatML model


@dataclass(frozen=True)
class ToolSettings:
    """The ingress's chat template override (its text), tool-call parser name, and the
    template for requests that render tools when the model's own template cannot."""

    chat_template: str | None = None
    tool_call_parser: str = DEFAULT_TOOL_PARSER
    tools_template: str | None = None

    def __post_init__(self) -> None:
        tool_parser(self.tool_call_parser)  # unknown names fail at startup

    @classmethod
    def from_flags(cls, chat_template: str | None, tool_call_parser: str | None,
                   builtin_model: bool = False) -> ToolSettings:
        tools_template = (load_chat_template(BUILTIN_MODEL_TOOL_TEMPLATE)
                          if builtin_model and not chat_template else None)
        return cls(load_chat_template(chat_template) if chat_template else None,
                   tool_call_parser or DEFAULT_TOOL_PARSER, tools_template)

    def template_for(self, req: ChatCompletionRequest, model_template: str | None
                     ) -> str | None:
        """The template replacing the model's for this request, or None (the model's)."""
        if self.chat_template is not None:
            return self.chat_template
        wants_tools = bool(req.tools) and req.tool_choice != "none"
        if wants_tools and self.tools_template and not template_renders_tools(model_template):
            return self.tools_template
        return None


def load_chat_template(name_or_path: str) -> str:
    """A shipped template by name ("tool_chatml", "tool_llama3_json") or a .jinja file."""
    shipped = TEMPLATES / f"{name_or_path}.jinja"
    path = shipped if shipped.is_file() else Path(name_or_path)
    if not path.is_file():
        names = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
        raise ValueError(f"chat template {name_or_path!r} is neither a shipped template "
                         f"({', '.join(names)}) nor a file")
    return path.read_text(encoding="utf-8")


def template_renders_tools(source: str | None) -> bool:
    """Templates that render tools read a `tools` variable; others would drop them silently."""
    return source is not None and "tools" in source


def rendered_tools(req: ChatCompletionRequest, template: str | None) -> list[dict] | None:
    """The tools to hand the chat template, or None; a 400 if the template cannot show them."""
    if not req.tools or req.tool_choice == "none":
        return None
    if not template_renders_tools(template):
        raise bad_request("This model's chat template cannot render tools. Start the server "
                          "with --chat-template tool_chatml (ChatML models), tool_llama3_json "
                          "(Llama 3) or a template file that renders `tools`.", param="tools")
    return [t.model_dump(exclude_none=True) for t in req.tools]


def forced_tool_spec(req: ChatCompletionRequest) -> StructuredSpec | None:
    """The constraint for "required" or a named function; None when the model chooses."""
    if not req.tools:
        return None
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        tool = next(t for t in req.tools if t.function.name == name)
        return StructuredSpec.from_json_schema(tool.function.parameters)
    if req.tool_choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "arguments": t.function.parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in req.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredSpec.from_json_schema(schema)


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolOutputParser:
    """Reads one choice's text according to the request's tool_choice."""

    req: ChatCompletionRequest
    parser: ToolParser | None  # None: tools off ("none" or no tools)

    @classmethod
    def for_request(cls, req: ChatCompletionRequest, settings: ToolSettings) -> ToolOutputParser:
        on = bool(req.tools) and req.tool_choice != "none"
        return cls(req, tool_parser(settings.tool_call_parser) if on else None)

    @property
    def forced(self) -> bool:
        return self.parser is not None and (self.req.tool_choice == "required"
                                            or isinstance(self.req.tool_choice, dict))

    def parse(self, text: str) -> ParsedOutput:
        if self.parser is None:
            return ParsedOutput(text)
        if isinstance(self.req.tool_choice, dict):
            name = self.req.tool_choice["function"]["name"]
            return ParsedOutput(None, [ParsedToolCall(name, text)])
        if self.req.tool_choice == "required":
            return _parse_required(text)
        return self.parser.parse(text)


def _parse_required(text: str) -> ParsedOutput:
    try:
        calls = json.loads(text)
        return ParsedOutput(None, [ParsedToolCall(c["name"], json.dumps(c["arguments"]))
                                   for c in calls])
    except (json.JSONDecodeError, TypeError, KeyError):  # truncated by max_tokens
        return ParsedOutput(text)


def response_tool_calls(parsed: ParsedOutput) -> list[ToolCall]:
    return [ToolCall(id=tool_call_id(), function=ToolCallFunction(name=c.name,
                                                                   arguments=c.arguments))
            for c in parsed.tool_calls]


def finish_reason_with_tools(finish_reason: str | None, parsed: ParsedOutput) -> str | None:
    """OpenAI's "tool_calls" when a complete output holds calls; "length" stays "length"."""
    return "tool_calls" if parsed.tool_calls and finish_reason == "stop" else finish_reason


@dataclass
class ToolCallStream:
    """Streams one choice: content is sent until a tool call may start; from there the text
    is held and, at the end, sent as tool-call deltas in OpenAI's shape."""

    reader: ToolOutputParser
    text: str = ""
    sent: int = 0  # characters of text already sent as content

    def content_delta(self, new_text: str) -> str:
        self.text += new_text
        if self.reader.parser is None:
            hold = len(self.text)
        elif self.reader.forced:
            return ""
        else:
            hold = self.reader.parser.hold_from(self.text)
        send_to = max(self.sent, hold)
        delta, self.sent = self.text[self.sent:send_to], send_to
        return delta

    def finish(self) -> tuple[str, list[DeltaToolCall], ParsedOutput]:
        """(content still to send, tool-call deltas, the parsed output)."""
        parsed = self.reader.parse(self.text)
        if not parsed.tool_calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, [], parsed
        deltas = [DeltaToolCall(index=i, id=tool_call_id(), type="function",
                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                  for i, c in enumerate(parsed.tool_calls)]
        return "", deltas, parsed
