"""Scheduling policies are objects: each answers its questions alone, and a new one is a class."""

from __future__ import annotations

import itertools

import pytest

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SCHEDULER_POLICIES, SchedulerConfig
from iterserve.replica.null_runner import NullRunner
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.scheduling_policy import (
    POLICIES,
    GuaranteedNoEvictPolicy,
    SchedulingPolicy,
    make_policy,
)

_ids = itertools.count()


def request(prompt_len: int, max_tokens: int = 8, arrival: float = 0.0,
            priority: int = 0) -> Request:
    return Request(f"p{next(_ids)}", [3] * prompt_len,
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   arrival, priority)


def test_every_configurable_policy_has_a_class() -> None:
    assert set(POLICIES) == set(SCHEDULER_POLICIES)
    with pytest.raises(ValueError, match="scheduler_policy"):
        make_policy("lifo", 100)


def test_victims_by_policy() -> None:
    old_low = request(4, arrival=0.0, priority=9)
    new_high = request(4, arrival=1.0, priority=0)
    assert make_policy("fcfs", 100).choose_victim([old_low, new_high]) is new_high
    for name in ("priority", "max_utilization"):
        assert make_policy(name, 100).choose_victim([old_low, new_high]) is old_low
    assert make_policy("guaranteed_no_evict", 100).choose_victim([old_low, new_high]) is None


def test_running_order_puts_decodes_first() -> None:
    prefill, decode = request(10), request(4)
    decode.output_token_ids.append(5)
    decode.num_computed_tokens = 4
    ordered = make_policy("fcfs", 100).order_running([prefill, decode])
    assert [r for r, _ in ordered] == [decode, prefill]
    assert [n for _, n in ordered] == [1, prefill.num_uncomputed_tokens]


def test_no_evict_admission_reserves_running_worst_cases() -> None:
    blocks = BlockManager(9, 4, enable_prefix_caching=False)
    policy = GuaranteedNoEvictPolicy(max_model_len=100)
    running = request(4, max_tokens=20)  # worst case 24 tokens: 6 blocks, holds 1
    blocks.allocate(running, 4)
    newcomer = request(4, max_tokens=12)  # worst case 16 tokens: 4 blocks
    assert not policy.fits(newcomer, 4, [], [running], blocks)  # 5 reserved + 4 > 8 free
    assert policy.fits(newcomer, 4, [], [], blocks)


def test_a_new_policy_is_one_class() -> None:
    choices: list[tuple[list[Request], Request | None]] = []

    class LongestFirstVictim(SchedulingPolicy):
        """Preempt the request holding the most tokens (frees the most blocks at once)."""

        name = "longest_victim"

        def choose_victim(self, candidates: list[Request]) -> Request | None:
            victim = max(candidates, key=lambda r: r.num_tokens, default=None)
            choices.append((list(candidates), victim))
            return victim

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    manager = BlockManager(8, 4, enable_prefix_caching=False)
    scheduler = Scheduler(config, manager, policy=LongestFirstVictim(64))
    for i, prompt_len in enumerate((12, 4, 6)):
        scheduler.add_request(request(prompt_len, max_tokens=14, arrival=float(i)))
    runner = NullRunner(8)
    preempted = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        preempted += output.preempted
        scheduler.update(output, runner.execute(output))
        manager.check_invariants()
    assert preempted and choices
    assert [victim for _, victim in choices] == preempted
    assert any(len(candidates) > 1 for candidates, _ in choices)
