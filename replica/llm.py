"""The offline entry point: `LLM(model=PATH, **engine_kwargs).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from iterserve.replica.config import EngineConfig, offline_cpu_threads
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.outputs import RequestOutput, TokenLogprobs
from iterserve.replica.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None  # a constrained request's dead end


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # With SamplingParams.prompt_logprobs: one entry per prompt position, the first None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        engine_kwargs.setdefault("cpu_threads", offline_cpu_threads())
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[LLMEngine], None] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion as one continuously batched workload.

        `on_step`, if given, is called after every engine step (tests check invariants there).
        `lora_name`: the adapter of every prompt, or one per prompt (None: the base model).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        adapters = ([lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str)
                    else list(lora_name))
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapter names")
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt, p, adapter in zip(prompts, params_list, adapters, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = self.engine.add_request(ids, p, lora_name=adapter)
            results[request_id] = GenerationResult(
                request_id, ids, [CompletionOutput(index=i) for i in range(p.n)]
            )
            order.append(request_id)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                result = results[output.request_id]
                _accumulate(result.outputs[output.index], output)
                if output.prompt_logprobs is not None and result.prompt_logprobs is None:
                    result.prompt_logprobs = output.prompt_logprobs
            if on_step is not None:
                on_step(self.engine)
        return [results[request_id] for request_id in order]


def _accumulate(target: CompletionOutput, delta: RequestOutput) -> None:
    target.text += delta.new_text
    target.token_ids += delta.new_token_ids
    target.logprobs += delta.logprobs or []
    if delta.finished:
        target.finish_reason = delta.finish_reason
        target.stop_reason = delta.stop_reason
        target.error = delta.error
