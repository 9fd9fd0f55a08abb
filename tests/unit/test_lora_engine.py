"""LoRA through the whole engine against PEFT's own model (fp32, greedy), mixed batches, and
the prefix cache's adapter namespaces. PEFT (test-only) makes the adapters: lora_testlib."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from iterserve.replica import LLM, SamplingParams
from iterserve.replica.lora_manager import UnknownAdapterError
from iterserve.replica.make_model import write_model
from tests.unit.lora_testlib import ADAPTER_TARGETS, make_adapter, peft_greedy

NUM_TOKENS = 12
NEAR_TIE = 1e-3  # a top-2 logit gap this small may flip between unmerged orders of sums


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = write_model(root / "base", seed=3)
    adapters = {name: make_adapter(base, root / name, targets, seed=10 + i, rslora=rslora)
                for i, (name, (targets, rslora)) in enumerate(ADAPTER_TARGETS.items())}
    return base, adapters


@pytest.fixture(scope="module")
def llm(setup: tuple[Path, dict[str, Path]]) -> LLM:
    base, adapters = setup
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8,
               lora_modules=modules, max_num_batched_tokens=64, block_size=16)


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("adapter", [None, *ADAPTER_TARGETS])
def test_greedy_equals_peft(setup: tuple[Path, dict[str, Path]], llm: LLM,
                            adapter: str | None) -> None:
    base, paths = setup
    prompts = prompts_of(7, [3, 17, 40])
    ours = [r.outputs[0].token_ids
            for r in llm.generate(prompts, GREEDY, lora_name=adapter)]
    theirs, gaps = peft_greedy(base, paths[adapter] if adapter else None, prompts, NUM_TOKENS)
    flips = 0
    for got, want, gap in zip(ours, theirs, gaps, strict=True):
        if got == want:
            continue
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        assert gap[first] < NEAR_TIE, (f"adapter {adapter}: diverges at token {first} where "
                                       f"PEFT's top-2 gap is {gap[first]:.3g} (not a near-tie)")
        flips += 1
    # Reported, not hidden (none seen at these seeds): a near-tie may flip between PEFT's
    # order of sums and ours; any other divergence fails above.
    print(f"adapter {adapter}: {flips} near-tie flip(s) of {len(prompts)} prompts")


def test_adapters_change_the_output(llm: LLM) -> None:
    prompts = prompts_of(8, [20])
    outs = {name: llm.generate(prompts, GREEDY, lora_name=name)[0].outputs[0].token_ids
            for name in [None, *ADAPTER_TARGETS]}
    assert len({tuple(v) for v in outs.values()}) == len(outs)


def test_mixed_batch_gives_each_request_its_alone_tokens(llm: LLM) -> None:
    prompts = prompts_of(9, [5, 33, 18, 2, 50, 9, 27, 12])
    names = [None, "all", "qv", "mlp_o", "qv", None, "all", "mlp_o"]
    alone = [llm.generate([p], GREEDY, lora_name=n)[0].outputs[0].token_ids
             for p, n in zip(prompts, names, strict=True)]
    mixed = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, lora_name=names)]
    assert mixed == alone


def test_no_prefix_hit_across_adapters(llm: LLM) -> None:
    prompt = prompts_of(10, [70])
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, params)  # base: its blocks are cached
    engine = llm.engine
    rid = engine.add_request(prompt[0], params, lora_name="qv")
    request = engine.scheduler.get_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert request.num_cached_tokens == 0  # base blocks are not the adapter's
    rid = engine.add_request(prompt[0], params, lora_name="qv")
    request = engine.scheduler.get_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert request.num_cached_tokens == 64  # the adapter's own blocks are


def test_unknown_adapter_is_refused_by_name(llm: LLM) -> None:
    with pytest.raises(UnknownAdapterError, match="`nope` does not exist"):
        llm.engine.add_request([1, 2, 3], GREEDY, lora_name="nope")


def test_more_adapters_than_slots_take_turns(setup: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = setup
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    small = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2,
                lora_modules=modules, max_num_batched_tokens=64, block_size=16, max_lora_rank=8)
    prompts = prompts_of(11, [6, 14, 9, 21, 4, 11])
    names = ["all", "qv", "mlp_o", None, "qv", "all"]
    seen: list[set[str]] = []

    def running_adapters(engine: object) -> None:
        seen.append({r.lora_name for r in small.engine.scheduler.running if r.lora_name})
        stats = small.engine.stats()  # what vllm:lora_requests_info reports
        assert set(stats.running_lora_adapters) == seen[-1] and stats.max_loras == 2
        assert not set(stats.waiting_lora_adapters) & seen[-1]

    mixed = [r.outputs[0].token_ids for r in small.generate(prompts, GREEDY, lora_name=names,
                                                            on_step=running_adapters)]
    assert max(map(len, seen)) == 2  # never more adapters than slots in a step
    alone = [small.generate([p], GREEDY, lora_name=n)[0].outputs[0].token_ids
             for p, n in zip(prompts, names, strict=True)]
    assert mixed == alone  # an adapter evicted from host memory is read again, same tokens


def test_an_adapter_evicted_from_host_memory_is_read_back_off_the_step(
        setup: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = setup
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    small = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
                lora_modules=modules, max_lora_rank=8)
    manager = small.engine.lora
    assert list(manager._host) == ["mlp_o"]  # the last registered: the LRU holds one
    assert small.engine.resident_loras() == ["mlp_o"]  # what the replica reports as held
    assert sorted(small.engine.list_loras()) == sorted(adapters)  # registered: all three
    manager.hold("qv")
    assert list(manager._host) == ["qv"]
    assert small.engine.resident_loras() == ["qv"]
