"""Scheduler and block manager over a null runner: the engine's rules without a model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.null_runner import NullRunner
from iterserve.replica.request import Request, RequestStatus
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler

_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int, arrival: float = 0.0, priority: int = 0,
                 first_token: int = 1) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=[first_token] + [(i * 31) % 997 for i in range(1, prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        arrival_time=arrival,
        priority=priority,
    )


def make_scheduler(num_blocks: int = 64, block_size: int = 4, prefix: bool = False,
                   **config: object) -> tuple[Scheduler, NullRunner]:
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    defaults.update(config)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    clock = itertools.count()
    return Scheduler(SchedulerConfig(**defaults), manager, clock=lambda: float(next(clock))), \
        NullRunner(num_blocks)


def run_to_completion(scheduler: Scheduler, runner: NullRunner, max_steps: int = 10_000,
                      on_step: object = None) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
        scheduler.block_manager.check_invariants()
        if on_step is not None:
            on_step(output)
        steps += 1
        if steps > max_steps:
            raise RuntimeError("requests starved")
    return steps


def test_token_budget_and_seq_limit_hold_every_step() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for length in (25, 3, 7, 12, 2):
        scheduler.add_request(make_request(length, 5))

    def check(output: object) -> None:
        assert output.num_batched_tokens <= 10
        assert len(output.scheduled) <= 3

    run_to_completion(scheduler, runner, on_step=check)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=16)
    short = make_request(4, 20)
    scheduler.add_request(short)
    output = scheduler.schedule()
    scheduler.update(output, runner.execute(output))
    scheduler.add_request(make_request(100, 4))  # a long prompt arrives mid-stream
    for _ in range(5):
        output = scheduler.schedule()
        assert output.scheduled[0].request is short and output.scheduled[0].is_decode
        assert output.num_batched_tokens <= 16  # the long prompt is chunked around the decode
        scheduler.update(output, runner.execute(output))


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=256, enable_chunked_prefill=False)
    request = make_request(100, 3)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.scheduled[0].num_new_tokens == 100


def test_finished_requests_free_blocks_and_waiting_join_next_step() -> None:
    scheduler, runner = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2)
    first, second, third = make_request(4, 1), make_request(4, 3), make_request(4, 3)
    for r in (first, second, third):
        scheduler.add_request(r)
    output = scheduler.schedule()
    assert [s.request for s in output.scheduled] == [first, second]
    scheduler.update(output, runner.execute(output))
    assert first.status == RequestStatus.FINISHED_LENGTH
    assert len(scheduler.block_manager.block_table(first.request_id)) == 0
    output = scheduler.schedule()  # the next step: third joins at once
    assert third in [s.request for s in output.scheduled]


def test_static_batching_never_admits_mid_batch() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2, batching="static")
    a, b, c = make_request(4, 2), make_request(4, 6), make_request(4, 2)
    for r in (a, b, c):
        scheduler.add_request(r)
    admitted_while_b_runs = []
    while b.status != RequestStatus.FINISHED_LENGTH:
        output = scheduler.schedule()
        admitted_while_b_runs += [s.request for s in output.scheduled if s.request is c]
        scheduler.update(output, runner.execute(output))
    assert admitted_while_b_runs == []
    output = scheduler.schedule()
    assert [s.request for s in output.scheduled] == [c]


def test_preemption_recomputes_and_keeps_generated_tokens() -> None:
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    requests = [make_request(6, 10, arrival=float(i)) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions > 0
    alone, _ = make_scheduler(num_blocks=64, block_size=4)
    fresh = [make_request(6, 10) for _ in range(3)]
    for r in fresh:
        alone.add_request(r)
    run_to_completion(alone, NullRunner(64))
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in fresh]


def test_guaranteed_no_evict_never_preempts() -> None:
    scheduler, runner = make_scheduler(num_blocks=10, block_size=4,
                                       scheduler_policy="guaranteed_no_evict")
    for i in range(6):
        scheduler.add_request(make_request(5, 12, arrival=float(i)))
    run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions == 0


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=1, scheduler_policy="priority")
    low, high = make_request(4, 2, arrival=0.0, priority=5), make_request(4, 2, arrival=1.0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    output = scheduler.schedule()
    assert output.scheduled[0].request is high


def test_max_utilization_preempts_lowest_priority_first() -> None:
    scheduler, runner = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=4,
                                       scheduler_policy="max_utilization")
    important = make_request(7, 8, arrival=1.0, priority=0)
    unimportant = make_request(7, 8, arrival=0.0, priority=9)
    scheduler.add_request(unimportant)
    scheduler.add_request(important)
    preempted = []
    run_to_completion(scheduler, runner, on_step=lambda o: preempted.extend(o.preempted))
    assert preempted and all(r is unimportant for r in preempted)


def test_admission_window_waits_for_free_slots() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=4, admission_min_free_slots=2)
    running = [make_request(4, 50) for _ in range(3)]
    for r in running:
        scheduler.add_request(r)
    output = scheduler.schedule()
    scheduler.update(output, runner.execute(output))
    late = make_request(4, 2)
    scheduler.add_request(late)  # one free slot of four: below the window of two
    output = scheduler.schedule()
    assert late not in [s.request for s in output.scheduled]


def test_abort_returns_every_block() -> None:
    scheduler, runner = make_scheduler()
    requests = [make_request(9, 20) for _ in range(4)]
    for r in requests:
        scheduler.add_request(r)
    for _ in range(3):
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    for r in requests:
        scheduler.abort_request(r.request_id)
    manager = scheduler.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0 and not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("prompt_len, max_tokens, error", [
    (300, 4, "context"),
    (0, 4, "empty"),
    (40, 200, "KV blocks"),
])
def test_requests_that_can_never_run_are_rejected_at_once(prompt_len: int, max_tokens: int,
                                                          error: str) -> None:
    scheduler, _ = make_scheduler(num_blocks=16, block_size=4)
    request = make_request(max(prompt_len, 1), max_tokens)
    if prompt_len == 0:
        request.prompt_token_ids = []
    with pytest.raises(ValueError, match=error):
        scheduler.add_request(request)
    assert scheduler.block_manager.num_used_blocks == 0


def test_prefix_cache_shares_blocks_and_evicts_lru() -> None:
    scheduler, runner = make_scheduler(num_blocks=32, block_size=4, prefix=True)
    first = make_request(17, 2, first_token=5)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    twin = make_request(17, 2, first_token=5)
    scheduler.add_request(twin)
    output = scheduler.schedule()
    assert twin.num_cached_tokens == 16  # four full blocks found; the last token recomputed
    assert output.scheduled[0].num_new_tokens == 1
    run_to_completion(scheduler, runner)
    assert twin.output_token_ids == first.output_token_ids
    manager = scheduler.block_manager
    assert manager.prefix_hits == 16


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 3)),
                     min_size=1, max_size=25),
    num_blocks=st.integers(16, 80),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(8, 96),
    max_seqs=st.integers(1, 12),
    policy=st.sampled_from(["fcfs", "priority", "guaranteed_no_evict", "max_utilization"]),
    batching=st.sampled_from(["continuous", "static"]),
    chunked=st.booleans(),
    prefix=st.booleans(),
    abort_every=st.integers(0, 7),
)
def test_random_workloads_keep_invariants_and_finish(
    lengths: list[tuple[int, int, int]], num_blocks: int, block_size: int, budget: int,
    max_seqs: int, policy: str, batching: str, chunked: bool, prefix: bool, abort_every: int,
) -> None:
    max_len = 96
    scheduler, runner = make_scheduler(
        num_blocks=num_blocks, block_size=block_size, prefix=prefix, max_num_seqs=max_seqs,
        max_num_batched_tokens=budget if chunked else max(budget, max_len),
        enable_chunked_prefill=chunked, scheduler_policy=policy, batching=batching,
        max_model_len=max_len,
    )
    accepted = []
    for i, (prompt_len, max_tokens, priority) in enumerate(lengths):
        request = make_request(prompt_len, max_tokens, arrival=float(i), priority=priority,
                               first_token=i % 3)
        try:
            scheduler.add_request(request)
        except ValueError:
            continue  # can never fit this cache: rejected up front, which is the contract
        accepted.append(request)
    step = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
        scheduler.block_manager.check_invariants()
        step += 1
        if abort_every and step % abort_every == 0 and scheduler.running:
            scheduler.abort_request(scheduler.running[0].request_id)
        assert step < 20_000, "a request starved"
    assert all(r.is_finished for r in accepted)
    for r in accepted:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.num_output_tokens == min(r.sampling_params.max_tokens,
                                              max_len - r.num_prompt_tokens)
    assert scheduler.block_manager.num_used_blocks == 0


def test_static_batch_pads_finished_rows_until_its_longest_request_ends() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2, batching="static")
    short, long = make_request(4, 2), make_request(4, 8)
    scheduler.add_request(short)
    scheduler.add_request(long)
    while not short.is_finished:
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    held = scheduler.block_manager.block_table(short.request_id)
    assert held, "a finished row keeps its blocks while the batch runs"
    output = scheduler.schedule()
    padding = [s for s in output.scheduled if s.is_padding]
    assert [s.request for s in padding] == [short] and not padding[0].samples
    scheduler.update(output, runner.execute(output))
    assert short.num_output_tokens == 2  # padding produced nothing
    run_to_completion(scheduler, runner)
    assert scheduler.block_manager.num_used_blocks == 0


def test_static_batch_without_padding_frees_rows_at_once() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2, batching="static",
                                       static_batch_padding=False)
    short, long = make_request(4, 2), make_request(4, 8)
    scheduler.add_request(short)
    scheduler.add_request(long)
    while not short.is_finished:
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    assert len(scheduler.block_manager.block_table(short.request_id)) == 0
    assert not any(s.is_padding for s in scheduler.schedule().scheduled)


@settings(max_examples=60, deadline=None)
@given(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 30),
       min_tokens=st.integers(0, 30), ignore_eos=st.booleans(),
       eos=st.sets(st.integers(0, 40), max_size=3),
       stop_ids=st.lists(st.integers(0, 40), max_size=3), max_model_len=st.integers(22, 60))
def test_the_per_token_stop_shortcut_stops_where_the_full_check_does(
        prompt_len: int, max_tokens: int, min_tokens: int, ignore_eos: bool, eos: set[int],
        stop_ids: list[int], max_model_len: int) -> None:
    """update() skips _stop_status unless a stopping id or the length limit is reached; the
    request must end at the same token, for the same reason, as checking every token."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                            ignore_eos=ignore_eos, stop_token_ids=stop_ids, temperature=0.0)
    results = []
    for full_check in (False, True):
        scheduler, _ = make_scheduler(max_model_len=max_model_len)
        runner = NullRunner(64, vocab_size=41)  # token ids 0-40: stops do fire
        request = Request("r", [(i * 7) % 41 for i in range(prompt_len)], params, 0.0,
                          eos_token_ids=frozenset(eos))
        scheduler.add_request(request)
        if full_check:  # what update() did before the shortcut: every token fully checked
            request.output_length_limit, request.stopping_token_ids = 0, frozenset()
        run_to_completion(scheduler, runner)
        results.append((request.output_token_ids, request.status, request.stop_reason))
    assert results[0] == results[1]


def test_a_request_whose_adapter_finds_no_slot_steps_aside_for_later_ones() -> None:
    """vLLM's rule: with max_loras adapters running, a request for another adapter waits
    for a slot, but the requests behind it (base-model ones, or the running adapters') are
    admitted meanwhile; it keeps its place in front of them."""
    manager = BlockManager(64, 4, enable_prefix_caching=False)
    clock = itertools.count()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                          max_model_len=256), manager,
                          clock=lambda: float(next(clock)), max_loras=1)
    runner = NullRunner(64)
    first, other, base, same = (make_request(6, 4, arrival=float(i)) for i in range(4))
    first.lora_name, other.lora_name, same.lora_name = "a", "b", "a"
    for request in (first, other, base, same):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert [s.request for s in output.scheduled] == [first, base, same]
    assert list(scheduler.waiting) == [other]
    scheduler.update(output, runner.execute(output))
    run_to_completion(scheduler, runner)
    assert other.status == RequestStatus.FINISHED_LENGTH and len(other.output_token_ids) == 4
