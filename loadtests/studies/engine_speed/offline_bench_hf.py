"""The HF transformers peers of the offline benchmark: `generate` in padded static batches, and
transformers' own continuous batching (the manager behind `generate_batch`).

Both run the model transformers builds from the same file the engine serves (a GGUF through
`gguf_file=`, or a checkpoint folder), in fp32, with EOS ignored so every request produces
exactly its `max_tokens`, as in the engine runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from iterserve.replica.model_source import is_gguf

if TYPE_CHECKING:
    from iterserve.autoscale.sim.workload import WorkloadRequest


@dataclass
class ThroughputResult:
    name: str
    seconds: float
    output_tokens: int
    threads: int
    preemptions: int = 0
    fallback: bool = False  # an engine CPU path fell back (its ratios are not reported)
    token_ids: list[list[int]] | None = None  # per request, where the engine keeps them

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def load_hf_model(model_path: Path) -> Any:
    """transformers' model for the engine's file or folder, fp32, eval mode, EOS off."""
    from transformers import AutoModelForCausalLM

    if is_gguf(model_path):
        hf = AutoModelForCausalLM.from_pretrained(str(model_path.parent),
                                                  gguf_file=model_path.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # ignore_eos, as in the engine runs
    return hf.eval()


def hf_generate(hf: Any, workload: list[WorkloadRequest], batch_size: int) -> ThroughputResult:
    """generate() in left-padded static batches of `batch_size` (each runs to its longest)."""
    pad = 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            n = len(w.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(w.prompt_token_ids)
            mask[row, width - n :] = 1
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                        max_new_tokens=max(w.max_tokens for w in batch))
        useful += sum(w.max_tokens for w in batch)  # tokens past a request's own length are waste
    return ThroughputResult("HF transformers generate (padded batches)",
                            time.perf_counter() - start, useful, torch.get_num_threads())


def hf_continuous(hf: Any, workload: list[WorkloadRequest], concurrency: int,
                  max_batch_tokens: int) -> ThroughputResult:
    """transformers' continuous batching: the manager `generate_batch` drives, fed each
    request's own max_new_tokens (generate_batch itself takes one for all)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=512)
    batching = ContinuousBatchingConfig(max_requests_per_batch=concurrency,
                                        max_batch_tokens=max_batch_tokens)
    start = time.perf_counter()
    tokens = 0
    with hf.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=batching, block=True,
            timeout=5, warmup=False) as manager:
        for w in workload:
            manager.add_request(w.prompt_token_ids, max_new_tokens=w.max_tokens, eos_token_id=-1)
        finished = 0
        while finished < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    return ThroughputResult("HF transformers continuous batching (generate_batch)",
                            time.perf_counter() - start, tokens, torch.get_num_threads())
