"""Completions and chat completions: run the engine streams, build bodies and SSE chunks.

The first engine output (or error) is awaited BEFORE a streaming response starts, so that a
full queue is a 429 and a bad request a 400 even with `stream: true`. Errors after the first
chunk are sent as an SSE `data: {"error": ...}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from iterserve.deploy.engine_client import EngineClient
from iterserve.deploy.errors import OpenAIHTTPError, http_error_for
from iterserve.deploy.protocol import (
    ChoiceState,
    ModelInfo,
    TokenText,
    UsageCounter,
    chat_logprobs,
    chat_prompt,
    check_prompt,
    completion_logprobs,
    completion_prompts,
    echo_texts,
    echoed_logprobs,
    prompt_logprobs_body,
    sampling_params,
)
from iterserve.deploy.schemas import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    now_s,
    random_id,
)
from iterserve.deploy.schemas_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from iterserve.deploy.tenant_requests import Tenancy, TenantRequest
from iterserve.deploy.tenants import Caller
from iterserve.deploy.tool_calls import (
    ToolCallStream,
    ToolOutputParser,
    ToolSettings,
    finish_reason_with_tools,
    response_tool_calls,
)
from iterserve.replica.lora_adapter import LoRARequest
from iterserve.replica.outputs import RequestOutput, TokenLogprobs
from iterserve.replica.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Indexed = tuple[int, RequestOutput]  # (prompt index, delta)
_DONE = object()


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[Indexed]:
    """Interleave several engine streams; closing the merge closes (aborts) all of them."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for out in stream:
                yield 0, out
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait((index, error))
            return
        queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Job:
    """One HTTP request's engine work: the prompts, their params and the merged stream."""

    request_id: str
    created: int
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    lora: LoRARequest | None = None  # the adapter the request's model names

    def open(self, client: EngineClient, priority: int, tenant: TenantRequest
             ) -> AsyncIterator[Indexed]:
        """The merged engine streams, in the tenant's cache namespace (the engine narrows it to
        the adapter's) and priority band, served for the tenant, metered for it."""
        streams = [client.generate(ids, p, f"{self.request_id}-{i}", tenant.band(priority),
                                   cache_namespace=tenant.cache_namespace,
                                   lora_request=self.lora, tenant=tenant.share)
                   for i, (ids, p) in enumerate(zip(self.prompts, self.params, strict=True))]
        return tenant.meter(merge_streams(streams))

    async def admit(self, tenancy: Tenancy | None, caller: Caller | None,
                    cache_salt: str | None) -> TenantRequest:
        """The tenant side of this job (a 429 over the tenant's quota): charged its prompts
        and what every choice may generate."""
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        max_tokens = sum((p.max_tokens or 0) * p.n for p in self.params)
        return await (tenancy or Tenancy()).begin(caller, cache_salt, prompt_tokens, max_tokens)


async def _first(stream: AsyncIterator[Indexed]) -> Indexed | None:
    """The first delta, or None when the stream is empty; errors surface here as HTTP."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except OpenAIHTTPError:
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI error body
        await stream.aclose()  # type: ignore[attr-defined]
        raise http_error_for(error) from error


async def _replay(first: Indexed | None, stream: AsyncIterator[Indexed]) -> AsyncIterator[Indexed]:
    if first is not None:
        yield first
    async for item in stream:
        yield item


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _sse_events(chunks: AsyncIterator[str], stream: AsyncIterator[Indexed]
                      ) -> AsyncIterator[str]:
    """Wrap chunk JSON into SSE; errors become an error event; always closes the engine.

    The stream ends with `data: [DONE]` after an error event too, as vLLM's does: clients
    that read until [DONE] (the OpenAI SDK) stop cleanly instead of waiting on a cut socket.
    A client that went away (CancelledError, GeneratorExit) gets nothing more."""
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - reported in-band: headers are already sent
        http_error = http_error_for(error)
        if http_error.status_code >= 500:
            logger.warning("stream failed: %s", type(error).__name__)
        yield _sse(json.dumps(http_error.body()))
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
        await stream.aclose()  # type: ignore[attr-defined]
    yield _sse("[DONE]")


def _streaming_response(events: AsyncIterator[str], headers: dict[str, str]
                        ) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      **headers})


# ----------------------------------------------------------------------------- completions


async def create_completion(req: CompletionRequest, client: EngineClient, info: ModelInfo,
                            tenancy: Tenancy | None = None, caller: Caller | None = None,
                            lora: LoRARequest | None = None
                            ) -> JSONResponse | StreamingResponse:
    tokenizer = await client.tokenizer()
    # Tokenising runs off the event loop (HF tokenizers release the GIL): a long prompt must
    # not stall every other request of this ingress.
    prompts = await asyncio.to_thread(completion_prompts, req, tokenizer, info)
    params = []
    for ids in prompts:
        check_prompt(ids, info)
        params.append(sampling_params(req, len(ids), info))
    job = Job(random_id("cmpl"), now_s(), lora.name if lora else info.model_name, prompts,
              params, req.n, lora)
    echo = echo_texts(req, prompts, tokenizer)
    tenant = await job.admit(tenancy, caller, req.cache_salt)
    stream = job.open(client, req.priority, tenant)
    first = await _first(stream)
    token_text = TokenText(tokenizer)
    if req.stream:
        chunks = _completion_chunks(req, job, echo, token_text, _replay(first, stream))
        return _streaming_response(_sse_events(chunks, stream), tenant.headers())
    states = {i: ChoiceState() for i in range(len(prompts) * req.n)}
    usage = UsageCounter(scoring_only=_scoring_only(req))
    async for p, out in _replay(first, stream):
        index = p * req.n + out.index
        states[index].add(out)
        usage.add(p, index, out)
    choices = []
    for index, state in states.items():
        p = index // req.n
        text, token_ids, items = _with_echo(req, job.prompts[p], echo[p], state.text,
                                            state.token_ids, state.logprobs,
                                            state.prompt_logprobs)
        logprobs = (completion_logprobs(token_ids, _pad(items, len(token_ids)), token_text, 0)
                    if req.logprobs is not None else None)
        prompt_logprobs = (prompt_logprobs_body(state.prompt_logprobs, token_text)
                           if state.prompt_logprobs is not None else None)
        choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                        finish_reason=state.finish_reason,
                                        stop_reason=state.stop_reason,
                                        prompt_logprobs=prompt_logprobs))
    body = CompletionResponse(id=job.request_id, created=job.created, model=job.model,
                              choices=choices, usage=usage.usage())
    return JSONResponse(body.model_dump(exclude_none=False), headers=tenant.headers())


def _scoring_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: return the scored prompt, drop the one token sampled."""
    return req.echo and req.max_tokens == 0


def _with_echo(req: CompletionRequest, prompt_ids: list[int], echo: str, text: str,
               token_ids: list[int], items: list[TokenLogprobs],
               scored_prompt: list[TokenLogprobs | None] | None
               ) -> tuple[str, list[int], list[TokenLogprobs | None]]:
    """A choice's (first) text, tokens and logprob entries: with echo, the prompt's first."""
    if _scoring_only(req):
        text, token_ids, items = "", [], []
    if not req.echo:
        return text, token_ids, list(items)
    return (echo + text, prompt_ids + token_ids,
            echoed_logprobs(prompt_ids, scored_prompt) + list(items))


def _pad(items: list[TokenLogprobs | None], length: int) -> list[TokenLogprobs | None]:
    """Logprob entries for `length` tokens (a runner that reports none leaves them None)."""
    return (items + [None] * length)[:length]


async def _completion_chunks(req: CompletionRequest, job: Job, echo: list[str],
                             token_text: TokenText, stream: AsyncIterator[Indexed]
                             ) -> AsyncIterator[str]:
    usage = UsageCounter(scoring_only=_scoring_only(req))
    offsets: dict[int, int] = {}  # choice index -> text offset of its next token
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(choice: CompletionChoice) -> str:
        body = CompletionStreamResponse(id=job.request_id, created=job.created,
                                        model=job.model, choices=[choice],
                                        usage=usage.usage() if continuous else None)
        return body.model_dump_json()

    async for p, out in stream:
        index = p * req.n + out.index
        usage.add(p, index, out)
        items: list[TokenLogprobs | None] = list(out.logprobs or [])
        text, token_ids = out.new_text, out.new_token_ids
        if index not in offsets:  # the first delta carries the echoed prompt, sent first
            text, token_ids, items = _with_echo(req, job.prompts[p], echo[p], text, token_ids,
                                                out.logprobs or [], out.prompt_logprobs)
            offsets[index] = 0
        logprobs = None
        if req.logprobs is not None and token_ids:
            logprobs = completion_logprobs(token_ids, _pad(items, len(token_ids)), token_text,
                                           offsets[index])
            offsets[index] += sum(len(t) for t in logprobs.tokens)
        if text or logprobs is not None or out.finished:
            yield chunk(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                         finish_reason=out.finish_reason if out.finished else None,
                                         stop_reason=out.stop_reason if out.finished else None))
    if req.include_usage:
        final = CompletionStreamResponse(id=job.request_id, created=job.created,
                                         model=job.model, choices=[], usage=usage.usage())
        yield final.model_dump_json()


# ------------------------------------------------------------------------------------ chat


async def create_chat_completion(req: ChatCompletionRequest, client: EngineClient,
                                 info: ModelInfo, tools: ToolSettings | None = None,
                                 tenancy: Tenancy | None = None, caller: Caller | None = None,
                                 lora: LoRARequest | None = None
                                 ) -> JSONResponse | StreamingResponse:
    tools = tools or ToolSettings()
    tokenizer = await client.tokenizer()
    template = tools.template_for(req, getattr(tokenizer, "chat_template", None))
    ids = await asyncio.to_thread(chat_prompt, req, tokenizer, info, template)
    check_prompt(ids, info)
    params = sampling_params(req, len(ids), info)
    job = Job(random_id("chatcmpl"), now_s(), lora.name if lora else info.model_name, [ids],
              [params], req.n, lora)
    tenant = await job.admit(tenancy, caller, req.cache_salt)
    stream = job.open(client, req.priority, tenant)
    first = await _first(stream)
    token_text = TokenText(tokenizer)
    num_top = req.top_logprobs or 0
    reader = ToolOutputParser.for_request(req, tools)
    if req.stream:
        chunks = _chat_chunks(req, job, token_text, reader, _replay(first, stream))
        return _streaming_response(_sse_events(chunks, stream), tenant.headers())
    states = {i: ChoiceState() for i in range(req.n)}
    usage = UsageCounter()
    async for _, out in _replay(first, stream):
        states[out.index].add(out)
        usage.add(0, out.index, out)
    choices = []
    for i, s in states.items():
        parsed = reader.parse(s.text)
        message = ChatResponseMessage(content=parsed.content,
                                      tool_calls=response_tool_calls(parsed) or None)
        choices.append(ChatChoice(
            index=i, message=message,
            logprobs=chat_logprobs(s.logprobs, token_text, num_top) if req.logprobs else None,
            finish_reason=finish_reason_with_tools(s.finish_reason, parsed),
            stop_reason=s.stop_reason))
    scored = states[0].prompt_logprobs
    body = ChatCompletionResponse(
        id=job.request_id, created=job.created, model=job.model, choices=choices,
        usage=usage.usage(),
        prompt_logprobs=prompt_logprobs_body(scored, token_text) if scored is not None else None)
    return JSONResponse(body.model_dump(), headers=tenant.headers())


async def _chat_chunks(req: ChatCompletionRequest, job: Job, token_text: TokenText,
                       reader: ToolOutputParser, stream: AsyncIterator[Indexed]
                       ) -> AsyncIterator[str]:
    usage = UsageCounter()
    started: set[int] = set()
    texts = {i: ToolCallStream(reader) for i in range(req.n)}
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    num_top = req.top_logprobs or 0

    def chunk(choice: ChatStreamChoice) -> str:
        body = ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model,
                                   choices=[choice],
                                   usage=usage.usage() if continuous else None)
        return body.model_dump_json()

    async for _, out in stream:
        usage.add(0, out.index, out)
        if out.index not in started:
            started.add(out.index)
            yield chunk(ChatStreamChoice(index=out.index,
                                         delta=DeltaMessage(role="assistant", content="")))
        logprobs = (chat_logprobs(out.logprobs, token_text, num_top)
                    if req.logprobs and out.logprobs else None)
        content = texts[out.index].content_delta(out.new_text)
        if content or logprobs is not None:
            yield chunk(ChatStreamChoice(index=out.index, delta=DeltaMessage(content=content),
                                         logprobs=logprobs))
        if out.finished:
            rest, tool_deltas, parsed = texts[out.index].finish()
            if rest or tool_deltas:
                yield chunk(ChatStreamChoice(index=out.index, delta=DeltaMessage(
                    content=rest or None, tool_calls=tool_deltas or None)))
            yield chunk(ChatStreamChoice(
                index=out.index, delta=DeltaMessage(),
                finish_reason=finish_reason_with_tools(out.finish_reason, parsed),
                stop_reason=out.stop_reason))
    if req.include_usage:
        final = ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model,
                                    choices=[], usage=usage.usage())
        yield final.model_dump_json()
