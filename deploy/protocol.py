"""Pure translation between the OpenAI bodies and the engine's records (no Ray, no HTTP).

Requests become (prompt token ids, SamplingParams) after the checks that depend on the
engine: context length, max_logprobs. RequestOutput deltas become OpenAI choices, chunks,
logprobs and usage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

from iterserve.deploy.errors import bad_request
from iterserve.deploy.schemas import (
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
)
from iterserve.deploy.schemas_chat import (
    ChatLogprobs,
    ChatTokenLogprob,
    TopLogprob,
)
from iterserve.deploy.structured_request import output_constraints
from iterserve.deploy.tool_calls import forced_tool_spec, rendered_tools
from iterserve.replica.outputs import RequestOutput, TokenLogprobs
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.tokenizer import compile_chat_template


class Tokenizer(Protocol):
    """What the ingress needs from the engine's tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str: ...

    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress knows about the model served by the replicas."""

    model_name: str
    model_path: str | None
    max_model_len: int
    max_logprobs: int
    vocab_size: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # flat engine config values


# ------------------------------------------------------------------------------- requests

DEFAULT_MAX_TOKEN_CHARS = 256  # when the tokenizer's vocabulary cannot be read


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer: Tokenizer) -> int:
    """The longest vocabulary entry in characters (byte-level BPE: in bytes): no token of any
    text covers more characters than this."""
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)  # type: ignore[attr-defined]
    except AttributeError:
        return DEFAULT_MAX_TOKEN_CHARS
    return max(map(len, vocab), default=DEFAULT_MAX_TOKEN_CHARS)


def check_text_size(texts: list[str], info: ModelInfo, tokenizer: Tokenizer,
                    param: str = "prompt") -> None:
    """Reject, BEFORE tokenising, text that cannot fit the context however it tokenises
    (x2 margin for normalisers), so a huge prompt costs a len() and not seconds of BPE."""
    limit = 2 * info.max_model_len * max_token_chars(tokenizer)
    total = sum(len(t) for t in texts)
    if total > limit:
        raise bad_request(
            f"The prompt has {total} characters, more than this model's context of "
            f"{info.max_model_len} tokens can hold. Please reduce the length of the prompt.",
            param=param)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer,
                       info: ModelInfo | None = None) -> list[list[int]]:
    """Every prompt of a completion request as token ids (a request may batch prompts)."""
    prompt = req.prompt
    if info is not None:
        if isinstance(prompt, str):
            check_text_size([prompt], info, tokenizer)
        elif all(isinstance(p, str) for p in prompt):
            for text in prompt:
                check_text_size([text], info, tokenizer)  # type: ignore[list-item]
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p, add_special_tokens=req.add_special_tokens) for p in prompt]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer: Tokenizer
               ) -> list[str]:
    """The text `echo` returns per prompt, as vLLM does: the prompt as sent when it is text,
    the decoded ids (special tokens included) when it is token ids."""
    if not req.echo:
        return [""] * len(prompts)
    if isinstance(req.prompt, str):
        return [req.prompt]
    if all(isinstance(p, str) for p in req.prompt):
        return list(req.prompt)  # type: ignore[arg-type]
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer,
                info: ModelInfo | None = None, chat_template: str | None = None) -> list[int]:
    """chat_template (--chat-template) replaces the model's own template when given."""
    messages = [m.template_fields() for m in req.messages]
    if info is not None:
        check_text_size([m["content"] for m in messages], info, tokenizer, "messages")
    tools = rendered_tools(req, chat_template or getattr(tokenizer, "chat_template", None))
    extra = {"tools": tools} if tools else {}
    try:
        if chat_template is None:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, **extra)
        else:
            text = _render_override(chat_template, tokenizer, messages,
                                    req.add_generation_prompt, extra)
    except (ValueError, TypeError, KeyError) as error:  # template rejected the conversation
        raise bad_request(f"messages: the chat template rejected them: {error}",
                          param="messages") from error
    # The template already carries the special tokens (BOS ...): don't add them twice.
    return tokenizer.encode(text, add_special_tokens=False)


def _render_override(source: str, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                     add_generation_prompt: bool, extra: dict[str, Any]) -> str:
    import jinja2

    try:
        return _compiled(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "", **extra)
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template failed: {error}") from error


@functools.lru_cache(maxsize=4)
def _compiled(source: str) -> Any:
    return compile_chat_template(source)


def check_prompt(token_ids: list[int], info: ModelInfo) -> None:
    if not token_ids:
        raise bad_request("The prompt is empty.", param="prompt")
    if info.vocab_size is not None and any(t < 0 or t >= info.vocab_size for t in token_ids):
        raise bad_request(f"Prompt token ids must be in [0, {info.vocab_size}).",
                          param="prompt")
    if len(token_ids) >= info.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {info.max_model_len} tokens. However, "
            f"your prompt has {len(token_ids)} tokens, which leaves no room for a completion. "
            "Please reduce the length of the prompt.", param="prompt")


def resolve_max_tokens(requested: int | None, prompt_len: int, info: ModelInfo,
                       param: str = "max_tokens") -> int:
    room = info.max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {info.max_model_len} tokens. However, "
            f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the length of the prompt or "
            f"of the completion.", param=param)
    return requested


def _check_logprobs(num: int | None, info: ModelInfo, param: str) -> None:
    if num is not None and num > info.max_logprobs:
        raise bad_request(f"{param} must be at most {info.max_logprobs}, got {num}.",
                          param=param)


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, prompt_len: int, info: ModelInfo
) -> SamplingParams:
    """SamplingParams for one prompt; ValueError from SamplingParams becomes a 400."""
    if isinstance(req, ChatCompletionRequest):
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_tokens = resolve_max_tokens(req.effective_max_tokens(), prompt_len, info, param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        _check_logprobs(logprobs, info, "top_logprobs")
        constraints = output_constraints(req, info.vocab_size, forced_tool_spec(req))
        prompt_logprobs = req.prompt_logprobs
    else:
        max_tokens = resolve_max_tokens(req.max_tokens, prompt_len, info)
        logprobs = req.logprobs
        _check_logprobs(logprobs, info, "logprobs")
        constraints = output_constraints(req, info.vocab_size)
        # vLLM: echo with logprobs scores the prompt with the same k.
        prompt_logprobs = (req.prompt_logprobs if req.prompt_logprobs is not None
                           else (req.logprobs if req.echo else None))
    _check_logprobs(prompt_logprobs, info, "prompt_logprobs")
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens}).",
                          param="min_tokens")
    if max_tokens == 0:  # echo scoring only: the engine samples one token, never returned
        max_tokens = 1
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(req.stop_list()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            **constraints.as_kwargs(),
        )
    except ValueError as error:
        raise bad_request(str(error)) from error


# ------------------------------------------------------------------------------ responses


class TokenText:
    """Token id -> display string, cached (logprobs name every token)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(token_ids: list[int], items: list[TokenLogprobs | None],
                        token_text: TokenText, start_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape, as vLLM fills it: per token its text, its logprob and a
    top_logprobs dict of the token itself then the top-k; an unscored token (the first
    echoed prompt token) has None for both."""
    out = CompletionLogprobs()
    offset = start_offset
    for token_id, item in zip(token_ids, items, strict=True):
        token = token_text(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if item is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(item.logprob))
        top = {token: _finite(item.logprob)}
        top.update((token_text(t), _finite(lp)) for t, lp in item.top)
        out.top_logprobs.append(top)
    return out


def echoed_logprobs(prompt_ids: list[int], scored: list[TokenLogprobs | None] | None
                    ) -> list[TokenLogprobs | None]:
    """The prompt's entries for an echo: one per prompt token (None where unscored)."""
    entries = list(scored or [])
    return entries + [None] * (len(prompt_ids) - len(entries))


def prompt_logprobs_body(scored: list[TokenLogprobs | None], token_text: TokenText
                         ) -> PromptLogprobs:
    """vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per position."""
    body: PromptLogprobs = []
    for item in scored:
        if item is None:
            body.append(None)
            continue
        position = {item.token_id: PromptLogprob(logprob=_finite(item.logprob), rank=item.rank,
                                                 decoded_token=token_text(item.token_id))}
        for rank, (t, lp) in enumerate(item.top, start=1):
            position.setdefault(t, PromptLogprob(logprob=_finite(lp), rank=rank,
                                                 decoded_token=token_text(t)))
        body.append(position)
    return body


def chat_logprobs(items: list[TokenLogprobs], token_text: TokenText,
                  num_top: int) -> ChatLogprobs:
    content = []
    for item in items:
        token = token_text(item.token_id)
        top = [TopLogprob(token=token_text(t), logprob=_finite(lp),
                          bytes=list(token_text(t).encode()))
               for t, lp in item.top[:num_top]]
        content.append(ChatTokenLogprob(token=token, logprob=_finite(item.logprob),
                                        bytes=list(token.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def _finite(value: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(float(value), -9999.0)


@dataclass
class ChoiceState:
    """One choice being accumulated from deltas (non-streaming) or tracked (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    sent_role: bool = False

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


@dataclass
class UsageCounter:
    """prompt tokens once per prompt, completion tokens summed over choices.

    cached_tokens counts each prompt's tokens served from the prefix cache, every tier (the
    device KV, the host KV tier), for its first choice (the one that computes the prompt;
    later choices of n > 1 reuse its blocks).
    `scoring_only` (echo with max_tokens 0) reports no completion tokens: the token the
    engine samples is never returned.
    """

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> tokens
    completion_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens
    cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> tokens
    scoring_only: bool = False

    def add(self, prompt_index: int, choice_index: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = out.num_prompt_tokens
        if out.index == 0:
            self.cached_tokens[prompt_index] = out.num_cached_tokens
        if not self.scoring_only:
            self.completion_tokens[choice_index] = max(
                self.completion_tokens.get(choice_index, 0), out.num_output_tokens)

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        details = PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values()))
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion, prompt_tokens_details=details)
