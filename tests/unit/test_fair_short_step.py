"""Under the fair policy a light tenant's request is not held back by a backlogged tenant's:
on equal counters it goes first, and the step that computes its prompt admits no backlogged
tenant's prompt after it (loadtests/studies/fair_share: B's TTFT under A's flood)."""

from __future__ import annotations

from iterserve.replica.fair_queue import FairWaitingQueue
from iterserve.replica.virtual_token_counter import VirtualTokenCounters
from tests.unit.test_fair_share import request, scheduler


def test_on_equal_counters_the_tenant_with_fewer_waiting_goes_first() -> None:
    queue = FairWaitingQueue(VirtualTokenCounters())
    for arrival in (0.0, 1.0):
        queue.push(request("heavy", arrival))
    light = request("light", 2.0)  # back from idle: lifted to heavy's counter exactly
    queue.push(light)
    assert queue.counters.counter("light") == queue.counters.counter("heavy")
    assert queue.pop() is light  # by arrival alone heavy's oldest would go first
    assert [r.tenant for r in (queue.pop(), queue.pop())] == ["heavy", "heavy"]


def first_step_tenants(policy: str) -> tuple[list[str], list[str]]:
    """Heavy has four prompts waiting, light one; four batch slots. Who is in the first
    step, and who in the second?"""
    s, runner = scheduler(max_num_seqs=4, policy=policy)
    for arrival in range(4):
        s.add_request(request("heavy", float(arrival)))
    s.add_request(request("light", 4.0))
    first = s.schedule()
    s.update(first, runner.execute(first))
    second = s.schedule()
    return ([r.request.tenant for r in first.scheduled],
            [r.request.tenant for r in second.scheduled if r.num_computed_tokens == 0])


def test_a_light_tenants_prompt_gets_a_step_without_a_backlogged_tenants_prompts() -> None:
    first, second = first_step_tenants("fair")
    assert first == ["light"]
    assert second == ["heavy", "heavy", "heavy"]  # next step: nothing lost, only deferred
    first, _ = first_step_tenants("fcfs")
    assert first == ["heavy", "heavy", "heavy", "heavy"]  # the check can fail


def test_a_tenant_alone_fills_its_steps_as_before() -> None:
    s, _ = scheduler(max_num_seqs=4)
    for arrival in range(4):
        s.add_request(request("only", float(arrival)))
    assert len(s.schedule().scheduled) == 4
