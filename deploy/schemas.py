"""pydantic models for every HTTP body of the OpenAI-compatible API.

Requests accept OpenAI's fields plus vLLM's sampling extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, priority, ...). Unknown fields are ignored, as vLLM and
OpenAI do. Field-level bounds raise pydantic validation errors, which the ingress turns into
400 responses in OpenAI's error shape; bounds that depend on the engine (max_logprobs,
max_model_len) are checked in `deploy/protocol.py`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

MAX_N = 16  # most choices per request (n)
MAX_LOGPROBS = 20  # OpenAI's own bound; the engine's max_logprobs may lower it
MAX_STOP_SEQUENCES = 8
MAX_STOP_TOKEN_IDS = 256

# Integer ranges, checked here, before routing, so that no value reaches the engine that a
# batched operation could choke on (a seed of 2**64 once killed the engine loop):
#   seed                               [-2**63, 2**63 - 1]  (vLLM: torch.iinfo(torch.long))
#   max_tokens, max_completion_tokens  [1, 2**31 - 1]       (then <= max_model_len - prompt)
#   min_tokens                         [0, 2**31 - 1]       (then <= max_tokens)
#   n, best_of                         [1, MAX_N]
#   logprobs, top_logprobs             [0, MAX_LOGPROBS]    (then <= the engine's max_logprobs)
#   top_k                              [-1, 2**31 - 1]      (-1 and 0 disable it)
#   priority                           [-2**31, 2**31 - 1]
#   token ids (prompt, stop_token_ids, logit_bias keys, detokenize tokens)
#                                      [0, 2**31 - 1]       (then < the model's vocab size)
#   logit_bias values                  [-100, 100]          (OpenAI's bound)
# Floats are finite where bounded (NaN and +-inf fail every bound).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_LOGIT_BIAS = 100.0

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def random_id(prefix: str) -> str:
    """An OpenAI-style id: `cmpl-...`, `chatcmpl-...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class _Body(BaseModel):
    """Request bodies: unknown fields are ignored (clients send extras freely)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _Out(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


# ---------------------------------------------------------------------------------- shared


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM extra
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Output constraints, checked in deploy/structured_request.py (a 400 on a bad one).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM extras ...
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # ... and their newer spelling
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM extras
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX)
    # vLLM's prefix-cache salt: the request shares cached blocks only with requests of the
    # same salt (inside its tenant's namespace; deploy/tenants.py).
    cache_salt: str | None = Field(None, max_length=1024)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _check_cache_salt(cls, salt: Any) -> Any:  # noqa: ANN401 - checked here
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return salt

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:32]!r}") from None
            if not 0 <= token_id <= INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids in [0, {INT32_MAX}], "
                                 f"got {token_id}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return bias

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingFields:
        stops = self.stop_list()
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop accepts at most {MAX_STOP_SEQUENCES} sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class PromptTokensDetails(_Out):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (device, host and disk tiers)


class UsageInfo(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(_Out):
    """vLLM's `Logprob`: one token's entry in a `prompt_logprobs` position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position None (the first) or {token id: PromptLogprob},
# the actual prompt token first, then the top-k.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Out):
    error: ErrorInfo


# ----------------------------------------------------------------------------- completions

PromptType = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)  # 0: score the prompt (with echo)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt must not be empty")
            if any(isinstance(p, list) and not p for p in self.prompt):
                raise ValueError("prompt token lists must not be empty")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo (scoring the prompt)")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self


class CompletionLogprobs(_Out):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra: non-streaming only


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------- chat


class ContentPart(_Body):
    type: str
    text: str | None = None


class ToolCallFunction(_Body):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def template_fields(self) -> dict[str, Any]:
        """The message as chat templates read it (tool calls with parsed arguments)."""
        fields: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            fields["name"] = self.name
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            fields["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        return fields

    def text(self) -> str:
        """The message's text; only text content parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content part type {part.type!r} is not supported")
            parts.append(part.text)
        return "".join(parts)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if self.tool_choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError("tool_choice must be none, auto, required or "
                                 "{'type': 'function', 'function': {'name': ...}}")
            if name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        for message in self.messages:
            message.text()  # raises for unsupported content parts
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens
