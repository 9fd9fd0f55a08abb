"""One request's fault ends that request alone; its batch mates and the engine go on.

Faults are injected (monkeypatched into one request's sampling or input preparation): the
real engine has no such bug left that a test could trigger, which is the point of the edge
validation. A device fault, in contrast, must stop the loop.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from iterserve.replica import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.errors import DeviceFaultError, EngineDeadError, RequestFailedError
from iterserve.replica.make_model import default_model_path
from iterserve.replica.sampler import Sampler
from iterserve.replica.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BAD = "bad-request"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in (5, 30, 12, 48)]


def run(engine: LLMEngine, prompts: list[list[int]], bad_index: int | None = None,
        bad_max_tokens: int = 12) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for i, prompt in enumerate(prompts):
        request_id = BAD if i == bad_index else f"r{i}"
        params = SamplingParams(temperature=0.8, max_tokens=bad_max_tokens, seed=7) \
            if i == bad_index else GREEDY
        engine.add_request(prompt, params, request_id)
        tokens[request_id] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
        engine.block_manager.check_invariants()
    return tokens, errors


def engine() -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=str(default_model_path())))


def assert_all_blocks_free(llm: LLMEngine) -> None:
    manager = llm.block_manager
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == manager.num_total_blocks


@pytest.fixture(scope="module")
def clean(prompts: list[list[int]]) -> dict[str, list[int]]:
    tokens, errors = run(engine(), prompts)
    assert not errors
    return tokens


def test_a_sampling_fault_ends_only_its_request(monkeypatch: pytest.MonkeyPatch,
                                                prompts: list[list[int]],
                                                clean: dict[str, list[int]]) -> None:
    draw = Sampler._draw

    def faulty_draw(self: Sampler, row: object, request: object) -> int:
        if request.request_id == BAD and request.num_output_tokens == 3:  # type: ignore[attr-defined]
            raise OverflowError("injected fault in one request's sampling")
        return draw(self, row, request)  # type: ignore[arg-type]

    monkeypatch.setattr(Sampler, "_draw", faulty_draw)
    llm = engine()
    tokens, errors = run(llm, prompts, bad_index=2)
    assert set(errors) == {BAD} and "injected fault" in errors[BAD]
    assert len(tokens[BAD]) == 3  # the tokens before the fault were delivered
    for request_id, expected in clean.items():
        if request_id != "r2":
            assert tokens[request_id] == expected, request_id
    assert_all_blocks_free(llm)
    # The engine still serves.
    again, errors = run(llm, prompts)
    assert not errors and again == clean


def test_a_batched_fault_is_isolated_by_running_requests_alone(
        monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]],
        clean: dict[str, list[int]]) -> None:
    llm = engine()
    execute = llm.runner.execute

    def choking_execute(scheduler_output: object) -> object:
        if any(s.request.request_id == BAD for s in scheduler_output.scheduled):  # type: ignore[attr-defined]
            raise IndexError("injected: a batched op choked on one request's inputs")
        return execute(scheduler_output)  # type: ignore[arg-type]

    monkeypatch.setattr(llm.runner, "execute", choking_execute)
    tokens, errors = run(llm, prompts, bad_index=1)
    assert set(errors) == {BAD} and tokens[BAD] == []
    for request_id, expected in clean.items():
        if request_id != "r1":
            assert tokens[request_id] == expected, request_id
    assert_all_blocks_free(llm)


def test_a_detokenizer_fault_ends_only_its_request(monkeypatch: pytest.MonkeyPatch,
                                                   prompts: list[list[int]],
                                                   clean: dict[str, list[int]]) -> None:
    llm = engine()
    detokenize = llm._detokenize

    def faulty(request: object, runner_output: object) -> object:
        if request.request_id == BAD:  # type: ignore[attr-defined]
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return detokenize(request, runner_output)  # type: ignore[arg-type]

    monkeypatch.setattr(llm, "_detokenize", faulty)
    tokens, errors = run(llm, prompts, bad_index=0)
    assert set(errors) == {BAD}
    assert {k: v for k, v in tokens.items() if k != BAD} == {k: v for k, v in clean.items()
                                                              if k != "r0"}
    assert_all_blocks_free(llm)


def test_a_stop_check_fault_ends_only_its_request(monkeypatch: pytest.MonkeyPatch,
                                                  prompts: list[list[int]],
                                                  clean: dict[str, list[int]]) -> None:
    stop_status = Scheduler._stop_status

    def faulty(self: Scheduler, request: object, token_id: int) -> object:
        if request.request_id == BAD and request.num_output_tokens == 4:  # type: ignore[attr-defined]
            raise TypeError("injected fault in one request's stop check")
        return stop_status(self, request, token_id)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "_stop_status", faulty)
    llm = engine()
    # The full check runs where a stop can fire: at a stop token, or here at its 4th and
    # last token (max_tokens 4); without the fault that request would end with "length".
    tokens, errors = run(llm, prompts, bad_index=3, bad_max_tokens=4)
    assert set(errors) == {BAD} and "injected fault" in errors[BAD]
    assert len(tokens[BAD]) == 4  # the token whose check failed is the last one sent
    for request_id, expected in clean.items():
        if request_id != "r3":
            assert tokens[request_id] == expected, request_id
    assert llm.finished_by_reason["error"] == 1
    assert_all_blocks_free(llm)
    again, errors = run(llm, prompts)
    assert not errors and again == clean


def test_out_of_range_seed_is_refused_before_the_engine() -> None:
    for seed in (2**63, 2**64, -(2**63) - 1, 10**30):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    for seed in (0, -1, 2**63 - 1, -(2**63)):
        SamplingParams(seed=seed)


def test_extreme_valid_seeds_sample_with_n_children() -> None:
    llm = engine()
    for i, seed in enumerate((2**63 - 1, -(2**63))):
        llm.add_request([11, 12, 13], SamplingParams(n=3, seed=seed, max_tokens=4), f"s{i}")
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert all(out.error is None for out in outputs)
    assert_all_blocks_free(llm)


def test_failed_request_raises_to_its_caller_and_the_loop_lives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    penalties = Sampler._apply_penalties

    def faulty(self: Sampler, row: object, request: object) -> None:
        if request.request_id == BAD:  # type: ignore[attr-defined]
            raise RuntimeError("injected (not a device fault)")
        penalties(self, row, request)  # type: ignore[arg-type]

    monkeypatch.setattr(Sampler, "_apply_penalties", faulty)
    async_engine = AsyncLLMEngine(EngineConfig.from_kwargs(model=str(default_model_path())))

    async def scenario() -> list[int]:
        async def consume(request_id: str) -> list[int]:
            tokens: list[int] = []
            async for out in async_engine.generate([5, 6, 7, 8], GREEDY, request_id):
                tokens += out.new_token_ids
            return tokens

        bad, good = await asyncio.gather(consume(BAD), consume("good"), return_exceptions=True)
        assert isinstance(bad, RequestFailedError), bad
        used = await async_engine.call(lambda engine: engine.block_manager.num_used_blocks)
        assert used == 0
        return good  # type: ignore[return-value]

    try:
        assert len(asyncio.run(scenario())) == GREEDY.max_tokens
        assert async_engine.is_healthy
    finally:
        async_engine.shutdown()


def test_a_device_fault_stops_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    async_engine = AsyncLLMEngine(EngineConfig.from_kwargs(model=str(default_model_path())))

    def device_fault(scheduler_output: object) -> object:
        raise DeviceFaultError("injected GPU fault")

    monkeypatch.setattr(async_engine.engine.runner, "execute", device_fault)

    async def scenario() -> BaseException:
        try:
            async for _ in async_engine.generate([5, 6, 7], GREEDY, "x"):
                pass
        except EngineDeadError as error:
            return error
        raise AssertionError("the stream must end with EngineDeadError")

    try:
        assert "injected GPU fault" in str(asyncio.run(scenario()))
        assert not async_engine.is_healthy
    finally:
        async_engine.shutdown()
