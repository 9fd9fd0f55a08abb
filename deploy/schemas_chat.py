"""pydantic models of the chat completion responses: whole answers and streamed chunks.

The request side, the shared usage / logprob bodies and the validation bounds are in
`deploy/schemas.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from iterserve.deploy.schemas import PromptLogprobs, ToolCall, UsageInfo, _Out


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Out):
    """An answer without calls has no `tool_calls` key, as OpenAI sends it and as vLLM does
    since its PR #44105 (before it vLLM sent `[]`): agent loops written against OpenAI test
    `message.tool_calls is not None` and then index an empty list (vLLM issue #44104)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = handler(self)
        if not self.tool_calls:
            fields.pop("tool_calls", None)
        return fields


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra: for the whole response


class DeltaMessage(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Out):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
