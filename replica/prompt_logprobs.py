"""Prompt log-probabilities (SamplingParams.prompt_logprobs), computed chunk by chunk.

A prefill chunk computes hidden states for prompt positions [start, end). The hidden state at
position q scores prompt token q + 1, so the chunk yields entries for positions start + 1 ..
min(end, P - 1) (the last prompt position scores the first generated token: that is the
sampler's row). Positions the request already holds (a recompute after preemption) are not
recomputed. Logits are formed and reduced to (token logprob, rank, top-k) a slice of rows at
a time, so no [prompt_len, vocab] tensor ever exists and only requests that ask pay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from iterserve.replica.outputs import PromptLogprobsChunk, ScheduledRequest, TokenLogprobs

# Rows of [rows, vocab] fp32 logits alive at once: 256 x 49152 x 4 B = 48 MiB at most.
ROWS_PER_SLICE = 256


@dataclass
class PromptLogprobsJob:
    """One request's share of this step: which flat rows score which prompt tokens."""

    request_id: str
    first_position: int  # prompt position scored by the first row
    rows: list[int]  # flat indices into this step's hidden states
    target_token_ids: list[int]  # the prompt token each row scores
    num_top: int


def plan_prompt_logprobs(scheduled: list[ScheduledRequest],
                         query_start_loc: np.ndarray) -> list[PromptLogprobsJob]:
    """The jobs for this step's prefill chunks of requests that want prompt logprobs."""
    jobs = []
    for i, s in enumerate(scheduled):
        request = s.request
        if s.is_padding or not request.wants_prompt_logprobs:
            continue
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        # Row q scores position q + 1; skip positions already held.
        first_row_position = max(start, request.num_prompt_logprobs_held - 1)
        last_row_position = min(end, request.num_prompt_tokens - 1)  # exclusive
        if first_row_position >= last_row_position:
            continue
        base = int(query_start_loc[i]) - start
        prompt = request.prompt_token_ids
        jobs.append(PromptLogprobsJob(
            request_id=request.request_id,
            first_position=first_row_position + 1,
            rows=list(range(base + first_row_position, base + last_row_position)),
            target_token_ids=prompt[first_row_position + 1:last_row_position + 1],
            num_top=request.sampling_params.prompt_logprobs or 0,
        ))
    return jobs


def compute_prompt_logprobs(
    hidden: torch.Tensor,  # [T, hidden] this step's hidden states
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [R, hidden] -> [R, V] fp32
    jobs: list[PromptLogprobsJob],
) -> dict[str, PromptLogprobsChunk]:
    """Raw-logit log-probabilities (no penalties, no temperature), as vLLM reports them."""
    rows = [row for job in jobs for row in job.rows]
    targets = [t for job in jobs for t in job.target_token_ids]
    max_top = max((job.num_top for job in jobs), default=0)
    token_lps: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        index = torch.tensor(rows[lo:lo + ROWS_PER_SLICE], device=hidden.device)
        target = torch.tensor(targets[lo:lo + ROWS_PER_SLICE], device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)  # [r, V]
        chosen = logprobs.gather(1, target[:, None])  # [r, 1]
        token_lps += chosen[:, 0].tolist()
        ranks += (logprobs >= chosen).sum(dim=-1).tolist()
        if max_top:
            values, indices = torch.topk(logprobs, max_top, dim=-1)  # [r, k]
            top_lps += values.tolist()
            top_ids += indices.tolist()
        del logprobs
    chunks: dict[str, PromptLogprobsChunk] = {}
    at = 0
    for job in jobs:
        entries = []
        for j, token_id in enumerate(job.target_token_ids):
            k = at + j
            top = (list(zip(top_ids[k][:job.num_top], top_lps[k][:job.num_top], strict=True))
                   if job.num_top else [])
            entries.append(TokenLogprobs(token_id=token_id, logprob=token_lps[k], top=top,
                                         rank=ranks[k]))
        at += len(job.target_token_ids)
        chunks[job.request_id] = PromptLogprobsChunk(job.first_position, entries)
    return chunks
