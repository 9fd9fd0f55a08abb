"""The host KV tier in the engine, on the tiny model (CPU): a returning chat turn whose prefix the
device KV evicted is copied back from host memory, and greedy tokens do not change."""

from __future__ import annotations

import random

import pytest

from iterserve.replica import EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.errors import DeviceFaultError
from iterserve.replica.make_model import default_model_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
DEVICE_BLOCKS = 12  # one conversation's turn fills 6: four evict each other
TIER_GIB = 64 * 2 * 4 * BLOCK * 4 * 32 * 4 / 2**30  # 64 blocks of the tiny model (fp32)


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(default_model_path())


def conversations() -> list[list[int]]:
    rng = random.Random(40)
    return [[rng.randrange(10, 4000) for _ in range(80)] for _ in range(4)]


def run_alone(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """One request to its end, the engine's invariants checked every step: (tokens, cached)."""
    engine.add_request(prompt, GREEDY)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
            cached = output.num_cached_tokens
        engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    return tokens, cached


def chat(model_path: str, **kwargs: object) -> tuple[list[list[int]], list[int], LLMEngine]:
    """Two turns of four conversations, one request at a time: every returning turn's prefix
    (its first turn and the answer) was evicted from the device by the other three."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=model_path, num_gpu_blocks_override=DEVICE_BLOCKS, block_size=BLOCK, **kwargs))
    histories = conversations()
    tokens, cached = [], []
    for turn in range(2):
        for i, history in enumerate(histories):
            answer, hit = run_alone(engine, history)
            tokens.append(answer)
            cached.append(hit)
            histories[i] = history + answer + [100 + turn, 200 + i]  # the user's next words
    return tokens, cached, engine


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_returning_turns_come_from_the_host_tier_with_the_same_tokens(
        model_path: str, async_scheduling: bool) -> None:
    off, cached_off, _ = chat(model_path, async_scheduling=async_scheduling)
    on, cached_on, engine = chat(model_path, async_scheduling=async_scheduling,
                                 kv_offloading_size=TIER_GIB)
    assert on == off
    manager, tier = engine.block_manager, engine.runner.host_tier
    # The first turns miss everywhere; each returning turn finds its 88-token history's
    # 5 full blocks in the host tier, where the device had evicted them.
    assert cached_off[4:] == [0, 0, 0, 0]
    assert cached_on[:4] == [0, 0, 0, 0] and cached_on[4:] == [5 * BLOCK] * 4
    assert manager.host_hits == 4 * 5 * BLOCK and manager.prefix_hits == 0
    assert manager.host_queries == sum(len(h) for h in conversations()) + 4 * (80 + 8 + 2)
    assert tier.bytes_copied["CPU_to_GPU"] == 4 * 5 * tier.bytes_per_block
    assert tier.bytes_copied["GPU_to_CPU"] >= tier.bytes_copied["CPU_to_GPU"]
    stats = engine.stats()  # what the metrics read: per tier, per transfer type
    assert (stats.host_cache_queries, stats.host_cache_hits) == (manager.host_queries,
                                                                  manager.host_hits)
    assert stats.kv_offload_bytes == tier.bytes_copied
    assert stats.kv_offload_seconds["CPU_to_GPU"] > 0


def test_preemption_with_the_tier_keeps_greedy_tokens(model_path: str) -> None:
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    shared = tokens(48)
    # A prompt caches the shared prefix, a long one evicts it to the host tier, then five
    # prompts on it at once run short of blocks: they preempt each other and come back.
    phases = [[shared + tokens(5)], [tokens(130)],
              [shared + tokens(n) for n in (5, 40, 17, 64, 9)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(**kwargs: object) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig.from_kwargs(model=model_path, block_size=BLOCK,
                                                    num_gpu_blocks_override=10, **kwargs))
        out: dict[str, list[int]] = {}
        for phase in phases:
            for prompt in phase:
                out[engine.add_request(prompt, params)] = []
            while engine.has_unfinished_requests():
                for output in engine.step():
                    out[output.request_id].extend(output.new_token_ids)
                engine.block_manager.check_invariants()
            assert engine.block_manager.num_used_blocks == 0
        return list(out.values()), engine

    off, _ = run(enable_prefix_caching=False)
    on, engine = run(kv_offloading_size=TIER_GIB)
    assert on == off
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.host_hits > 0  # the shared prefix came back from the host


def test_an_abort_after_a_copy_back_returns_every_block(model_path: str) -> None:
    _, _, engine = chat(model_path, kv_offloading_size=TIER_GIB)
    prompt = conversations()[0] + list(range(300, 330))  # its first turn's blocks are in the tier
    hits_before = engine.block_manager.host_hits
    request_id = engine.add_request(prompt, GREEDY)
    engine.step()  # admitted: its prefix copied back, the rest prefilled
    assert engine.block_manager.host_hits > hits_before
    engine.abort_request(request_id)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_the_simulated_runner_refuses_a_host_tier() -> None:
    with pytest.raises(ValueError, match="needs runner='model'"):
        LLMEngine(EngineConfig.from_kwargs(runner="simulated", kv_offloading_size=1.0))


def test_auto_sizes_the_tier_from_free_memory_where_the_engine_starts(model_path: str) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(model=model_path, kv_offloading_size="auto",
                                                num_gpu_blocks_override=DEVICE_BLOCKS))
    tier = engine.runner.host_tier
    assert tier.num_slots > 0 and engine.block_manager.host.num_slots == tier.num_slots
    assert tier.nbytes <= 64 * 2**30


def test_a_failed_copy_back_stops_the_step_instead_of_reading_stale_kv(
        model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault isolation reruns a failed step's requests one by one without its copies: a hit
    whose blocks never came back would then attend to whatever the device block held. A copy
    that raises is therefore a fault of the whole step, as a device error is."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=model_path, num_gpu_blocks_override=DEVICE_BLOCKS, block_size=BLOCK,
        kv_offloading_size=TIER_GIB))
    histories = conversations()
    answers = [run_alone(engine, history)[0] for history in histories]  # evicts to the host
    tier = engine.runner.host_tier

    def broken_load(*_args: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(tier, "load", broken_load)
    engine.add_request(histories[0] + answers[0] + [100, 200], GREEDY)
    with pytest.raises(DeviceFaultError, match="host KV tier copy failed"):
        while engine.has_unfinished_requests():
            engine.step()
