"""Client-side timing of one streamed OpenAI completion, and its request body (shared by
Locust and `bench`).

Definitions (vLLM `bench serve`; see reference/loadtests-observability.md 1.6):
* TTFT: request sent -> first SSE chunk carrying text;
* ITL: every gap between consecutive text chunks (a chunk may hold several tokens);
* E2E: request sent -> last text chunk (the trailing usage chunk and [DONE] do not count);
* TPOT: (E2E - TTFT) / (output_tokens - 1), only when output_tokens > 1.
Output tokens come from the usage chunk (``stream_options.include_usage``), else are the
number of text chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from iterserve.autoscale.sim.workload import WorkloadRequest

DONE = "[DONE]"


def completion_body(request: WorkloadRequest, model: str, stream: bool = True) -> dict[str, Any]:
    """An OpenAI /v1/completions body with exact lengths (token-id prompt, ignore_eos)."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(request.prompt_token_ids),
        "max_tokens": request.max_tokens, "min_tokens": request.max_tokens,
        "ignore_eos": True, "temperature": 0.0, "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class StreamTiming:
    """Fed with SSE lines and their arrival times (seconds, any monotonic clock)."""

    start: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    text_chunks: int = 0
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    _buffer: str = ""

    def feed_bytes(self, data: bytes | str, now: float) -> None:
        """Feed raw body bytes as they arrive; complete lines are parsed at time `now`."""
        self._buffer += data.decode("utf-8") if isinstance(data, bytes) else data
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            self.feed_line(line, now)

    def feed_line(self, line: str, now: float) -> None:
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separators, ": ping" comments, event: lines
        payload = line[len("data:"):].strip()
        if payload == DONE:
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            self.error = f"unparseable SSE data: {payload[:80]!r}"
            return
        self._on_chunk(chunk, now)

    def _on_chunk(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            self.error = str(chunk["error"])
            return
        usage = chunk.get("usage")
        if usage:
            self.usage_output_tokens = usage.get("completion_tokens")
            self.usage_prompt_tokens = usage.get("prompt_tokens")
        for choice in chunk.get("choices") or ():
            text = choice.get("text")
            if text is None:  # chat chunks carry delta.content
                text = (choice.get("delta") or {}).get("content")
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if text:
                self._on_text(now)

    def _on_text(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.chunk_gaps.append(now - (self.last_token_at or now))
        self.last_token_at = now
        self.text_chunks += 1

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_at is not None

    @property
    def output_tokens(self) -> int:
        return self.usage_output_tokens if self.usage_output_tokens is not None else (
            self.text_chunks)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def e2e_s(self) -> float | None:
        return None if self.last_token_at is None else self.last_token_at - self.start

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)
