"""The engine end to end on the tiny default model (CPU, fp32, torch attention)."""

from __future__ import annotations

import asyncio
import random

import pytest

from iterserve.replica import LLM, AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.make_model import default_model_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(default_model_path())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [3, 17, 40, 5, 64, 33, 9, 100]
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in lengths]


def greedy_tokens(model_path: str, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    llm = LLM(model_path, **kwargs)
    checked = []

    def check(engine: LLMEngine) -> None:
        engine.block_manager.check_invariants()
        checked.append(engine.block_manager.num_used_blocks)

    results = llm.generate(prompts, GREEDY, on_step=check)
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def baseline(model_path: str, prompts: list[list[int]]) -> list[list[int]]:
    tokens = greedy_tokens(model_path, prompts, enable_prefix_caching=False)
    assert all(len(t) == 24 for t in tokens)
    return tokens


@pytest.mark.parametrize("kwargs", [
    dict(enable_chunked_prefill=False, max_num_batched_tokens=4096),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(num_gpu_blocks_override=12, block_size=16),  # forces preemption by recompute
    dict(batching="static", max_num_seqs=3),
    dict(scheduler_policy="guaranteed_no_evict", num_gpu_blocks_override=20),
    dict(block_size=32, max_num_seqs=2),
], ids=["no-chunking", "small-chunks", "preemption", "static", "no-evict", "bs32"])
def test_greedy_outputs_identical_across_schedules(model_path: str, prompts: list[list[int]],
                                                   baseline: list[list[int]],
                                                   kwargs: dict) -> None:
    assert greedy_tokens(model_path, prompts, **kwargs) == baseline


def test_preemption_really_happens_with_few_blocks(model_path: str,
                                                   prompts: list[list[int]]) -> None:
    llm = LLM(model_path, num_gpu_blocks_override=12, block_size=16)
    llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_on_and_off_agree_on_shared_prefixes(model_path: str) -> None:
    shared = list(range(100, 180))
    prompts = [shared + [7, 8, 9 + i] for i in range(6)]
    off = greedy_tokens(model_path, prompts, enable_prefix_caching=False, max_num_seqs=2)
    llm = LLM(model_path, enable_prefix_caching=True, max_num_seqs=2)
    on = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    assert on == off
    assert llm.engine.block_manager.prefix_hits >= 4 * 80 // 16 * 16


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_path: str) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = LLM(model_path).generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    crowd = LLM(model_path).generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4]],
        [SamplingParams(temperature=1.0, max_tokens=10), params,
         SamplingParams(temperature=1.0, max_tokens=20)],
    )
    assert crowd[1].outputs[0].token_ids == alone


def test_stop_string_ends_output_and_is_not_included(model_path: str) -> None:
    llm = LLM(model_path)
    full = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30,
                                                           ignore_eos=True))[0].outputs[0].text
    stop = full[10:14]
    assert stop.strip(), "the tiny model should produce some text"
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30,
                                                          stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.startswith(out.text)


def test_min_tokens_and_max_tokens(model_path: str) -> None:
    llm = LLM(model_path)
    eos = sorted(llm.engine.eos_token_ids)[0]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                   stop_token_ids=[eos]))[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_n_children_share_the_prompt_blocks(model_path: str) -> None:
    llm = LLM(model_path)
    prompt = list(range(200, 264))
    result = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                   ignore_eos=True))[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    assert llm.engine.block_manager.prefix_hits >= 2 * 48  # children reuse full prompt blocks


def test_logprobs_are_returned(model_path: str) -> None:
    out = LLM(model_path).generate([[3, 4]], SamplingParams(temperature=0, max_tokens=3,
                                                            logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == 3
    for lp, token in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == token and len(lp.top) == 5
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.logprob <= 0


@pytest.mark.parametrize("build, message", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: EngineConfig.from_kwargs(scheduler_policy="lifo"), "scheduler_policy"),
    (lambda: EngineConfig.from_kwargs(no_such_flag=1), "unknown engine argument"),
])
def test_bad_settings_raise_value_error(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_bad_requests_raise_and_leave_no_blocks(model_path: str) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(model=model_path, max_model_len=128))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(1, 200)), GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, -5, 10**9], GREEDY)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request([1, 2], SamplingParams(logprobs=50))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0


def test_abort_frees_blocks_mid_generation(model_path: str) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(model=model_path))
    ids = [engine.add_request(list(range(1, 40)), GREEDY) for _ in range(3)]
    engine.add_request(list(range(1, 10)), SamplingParams(n=2, max_tokens=30))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    for request_id in ids + ["req-3"]:
        engine.abort_request(request_id)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_usage == 0.0


def test_async_engine_streams_and_closing_a_stream_aborts(model_path: str) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(model=model_path))
        try:
            deltas = [o async for o in engine.generate([1, 2, 3], GREEDY, "a")]
            assert sum(len(d.new_token_ids) for d in deltas) == 24 and deltas[-1].finished
            stream = engine.generate(list(range(5, 50)), SamplingParams(max_tokens=500,
                                                                        ignore_eos=True), "b")
            async for _ in stream:
                break
            await stream.aclose()
            used = await engine.call(lambda e: (e.block_manager.num_used_blocks,
                                                e.scheduler.num_running))
            assert used == (0, 0)
            with pytest.raises(ValueError):
                async for _ in engine.generate(list(range(1, 5000)), GREEDY, "c"):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_dummy_load_format_needs_no_weights(tmp_path: object) -> None:
    from iterserve.replica.make_model import write_model

    folder = write_model(tmp_path, overrides={"num_hidden_layers": 2}, with_weights=False)
    assert not (folder / "model.safetensors").exists()
    with pytest.raises(FileNotFoundError):
        LLM(str(folder))
    out = LLM(str(folder), load_format="dummy").generate([[1, 2, 3]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 24


def test_swap_space_is_refused_rather_than_ignored() -> None:
    with pytest.raises(ValueError, match="recomputes"):
        EngineConfig.from_kwargs(swap_space=4)
