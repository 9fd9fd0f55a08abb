"""SamplingParams.prompt_logprobs: parity with HF transformers, chunking, preemption, cache.

The tiny random model in fp32; HF transformers (a test-only dependency) loads the same
checkpoint and scores the same prompts in one forward pass each.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from iterserve.replica import LLM, SamplingParams
from iterserve.replica.make_model import write_model
from iterserve.replica.outputs import TokenLogprobs

transformers = pytest.importorskip("transformers")

LENGTHS = [1, 2, 7, 16, 17, 40, 75]
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("lp"), seed=5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 4000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_logprobs(checkpoint: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """[len - 1, V] log-probabilities of each prompt's positions 1.. from HF."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                              dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits[0].float()  # [len, V]
            out.append(torch.log_softmax(logits, dim=-1)[:-1])
    return out


def run(checkpoint: Path, prompts: list[list[int]], **engine_kwargs: object
        ) -> list[list[TokenLogprobs | None]]:
    llm = LLM(str(checkpoint), dtype="float32", block_size=16, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    results = llm.generate(prompts, params, on_step=lambda e: e.block_manager.check_invariants())
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks
    return [r.prompt_logprobs for r in results]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_hf(checkpoint: Path, prompts: list[list[int]],
                                  hf_logprobs: list[torch.Tensor],
                                  async_scheduling: bool) -> None:
    # A 16-token budget splits every longer prompt into chunks, several per step; with
    # async scheduling, step N+1 is planned and launched before step N is recorded.
    ours = run(checkpoint, prompts, max_num_batched_tokens=16,
               async_scheduling=async_scheduling)
    for prompt, entries, reference in zip(prompts, ours, hf_logprobs, strict=True):
        assert len(entries) == len(prompt) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            row = reference[position - 1]
            assert entry.token_id == prompt[position]
            assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
            assert entry.rank == int((row >= row[prompt[position]]).sum())
            values, indices = torch.topk(row, TOP)
            assert [t for t, _ in entry.top] == indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_chunked_prefill_on_and_off_agree(checkpoint: Path, prompts: list[list[int]]) -> None:
    chunked = run(checkpoint, prompts, max_num_batched_tokens=16)
    whole = run(checkpoint, prompts, enable_chunked_prefill=False)
    for a, b in zip(chunked, whole, strict=True):
        assert [e.token_id for e in a[1:]] == [e.token_id for e in b[1:]]
        assert [e.logprob for e in a[1:]] == pytest.approx([e.logprob for e in b[1:]], abs=1e-4)
        assert [[t for t, _ in e.top] for e in a[1:]] == [[t for t, _ in e.top] for e in b[1:]]


def test_preemption_recompute_adds_no_duplicates(checkpoint: Path,
                                                 prompts: list[list[int]]) -> None:
    long_prompts = [p for p in prompts if len(p) >= 16]
    reference = run(checkpoint, long_prompts, max_num_batched_tokens=16)
    # 9 blocks of 16 tokens for four requests that grow to 40-99 tokens: some are
    # preempted and recompute their prompt.
    llm = LLM(str(checkpoint), dtype="float32", block_size=16, max_num_batched_tokens=32,
              num_gpu_blocks_override=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            prompt_logprobs=TOP)
    results = llm.generate(long_prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for result, expected in zip(results, reference, strict=True):
        assert len(result.prompt_logprobs) == len(result.prompt_token_ids)
        assert [e.logprob for e in result.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in expected[1:]], abs=1e-4)


def test_prompt_logprobs_bypass_the_prefix_cache(checkpoint: Path,
                                                 prompts: list[list[int]]) -> None:
    prompt = prompts[-1]  # 75 tokens: four full blocks to hit
    llm = LLM(str(checkpoint), dtype="float32", block_size=16)
    engine = llm.engine

    def serve(params: SamplingParams) -> tuple[int, list[TokenLogprobs | None] | None]:
        engine.add_request(prompt, params)
        cached, scored = 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                cached = out.num_cached_tokens
                scored = out.prompt_logprobs if out.prompt_logprobs is not None else scored
        return cached, scored

    plain = SamplingParams(temperature=0.0, max_tokens=2)
    scoring = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    first_cached, _ = serve(plain)
    warm_cached, _ = serve(plain)
    scored_cached, scored = serve(scoring)
    assert first_cached == 0 and warm_cached == 64  # the cache is warm for this prompt
    assert scored_cached == 0  # ... but a scoring request computes every position
    assert len(scored) == len(prompt) and all(e.top == [] for e in scored[1:])
    cold = LLM(str(checkpoint), dtype="float32", block_size=16).generate([prompt], scoring)[0]
    assert [e.logprob for e in scored[1:]] == pytest.approx(
        [e.logprob for e in cold.prompt_logprobs[1:]], abs=1e-6)


def test_prompt_logprobs_validation(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    llm = LLM(str(checkpoint), dtype="float32", max_logprobs=4)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 4"):
        llm.engine.add_request([5, 6, 7], SamplingParams(prompt_logprobs=5))


def test_recompute_plans_only_positions_not_yet_held() -> None:
    """After a preemption mid-prefill, the recomputed chunk scores only the missing positions,
    and a chunk overlapping what is held adds nothing twice."""
    import numpy as np

    from iterserve.replica.outputs import PromptLogprobsChunk, ScheduledRequest
    from iterserve.replica.prompt_logprobs import plan_prompt_logprobs
    from iterserve.replica.request import Request

    prompt = list(range(100, 110))
    request = Request("r", prompt, SamplingParams(prompt_logprobs=1), arrival_time=0.0)
    assert request.prompt_logprobs == [None]

    def entries(first: int, last: int) -> PromptLogprobsChunk:
        return PromptLogprobsChunk(first, [TokenLogprobs(100 + p, -float(p), [])
                                           for p in range(first, last + 1)])

    request.record_prompt_logprobs(entries(1, 4))  # the first chunk scored positions 1-4
    recompute = ScheduledRequest(request, num_computed_tokens=0, num_new_tokens=8,
                                 block_table=[0])
    other = ScheduledRequest(Request("o", [1, 2], SamplingParams(), 0.0), 0, 2, [1])
    (job,) = plan_prompt_logprobs([other, recompute], np.array([0, 2, 10]))
    assert job.first_position == 5 and job.rows == [6, 7, 8, 9]  # flat rows of q = 4..7
    assert job.target_token_ids == prompt[5:9]
    request.record_prompt_logprobs(entries(3, 8))  # overlaps 3-4: only 5-8 are new
    assert [e.logprob for e in request.prompt_logprobs[1:]] == [-1.0 * p for p in range(1, 9)]
    with pytest.raises(RuntimeError, match="only 9 held"):
        request.record_prompt_logprobs(entries(10, 10))
