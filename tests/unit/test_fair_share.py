"""The fair policy: VTC between tenants in the engine's waiting queue (replica/fair_queue.py,
replica/virtual_token_counter.py), on the real scheduler and the simulated-runner engine."""

from __future__ import annotations

import itertools

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import EngineConfig, SchedulerConfig
from iterserve.replica.fair_queue import FairWaitingQueue
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.null_runner import NullRunner
from iterserve.replica.request import Request, TenantShare
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.scheduling_policy import make_policy
from iterserve.replica.virtual_token_counter import (
    OUTPUT_TOKEN_COST,
    PROMPT_TOKEN_COST,
    VirtualTokenCounters,
)

_ids = itertools.count()


def request(tenant: str, arrival: float, prompt_len: int = 8, max_tokens: int = 4,
            weight: float = 1.0, priority: int = 0) -> Request:
    return Request(f"f{next(_ids)}", [3] * prompt_len,
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   arrival, priority, tenant=tenant, tenant_weight=weight)


def scheduler(max_num_seqs: int = 1, policy: str = "fair", **config: object
              ) -> tuple[Scheduler, NullRunner]:
    settings = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=256,
                    scheduler_policy=policy, **config)
    clock = itertools.count()
    return Scheduler(SchedulerConfig(**settings), BlockManager(64, 4, enable_prefix_caching=False),
                     clock=lambda: float(next(clock))), NullRunner(64)


def step(s: Scheduler, runner: NullRunner) -> list[Request]:
    output = s.schedule()
    return s.update(output, runner.execute(output))


def drain(s: Scheduler, runner: NullRunner) -> None:
    while s.has_unfinished_requests():
        step(s, runner)


def admitted_after_heavys_first(policy: str) -> Request:
    """Heavy sends three requests, light one just after; one runs at a time. Which request
    runs once heavy's first has finished?"""
    s, runner = scheduler(policy=policy)
    first = request("heavy", 0.0)
    for r in (first, request("heavy", 1.0), request("heavy", 2.0)):
        s.add_request(r)
    step(s, runner)  # heavy's first runs before light's arrives
    s.add_request(request("light", 3.0))
    while first.status.is_finished is False:
        step(s, runner)  # heavy has been served; light, backlogged too, has not
    s.schedule()
    return s.running[0]


def test_a_heavy_tenants_new_request_loses_to_a_light_tenants_at_equal_priority() -> None:
    assert admitted_after_heavys_first("fair").tenant == "light"  # although it came later
    assert admitted_after_heavys_first("fcfs").tenant == "heavy"  # the check can fail


def test_a_higher_band_runs_first_whatever_its_tenants_counter() -> None:
    s, runner = scheduler()
    s.add_request(request("heavy", 0.0, priority=-1))
    drain(s, runner)
    urgent_heavy = request("heavy", 2.0, priority=-1)
    s.add_request(request("light", 1.0))
    s.add_request(urgent_heavy)
    s.schedule()
    assert s.running == [urgent_heavy]


def test_counters_move_per_served_token_divided_by_weight() -> None:
    s, runner = scheduler()
    counters = s.counters
    s.add_request(request("a", 0.0, prompt_len=8, max_tokens=3, weight=2.0))
    seen = []
    while s.has_unfinished_requests():
        step(s, runner)
        seen.append(counters.counter("a"))
    prompt = PROMPT_TOKEN_COST * 8 / 2.0
    per_token = OUTPUT_TOKEN_COST / 2.0
    assert seen == [prompt + per_token, prompt + 2 * per_token, prompt + 3 * per_token]


def test_a_tenant_back_from_idle_is_lifted_to_the_backlogged_minimum() -> None:
    s, runner = scheduler()
    for i in range(3):
        s.add_request(request("busy", float(i)))
    step(s, runner)  # busy is served, stays backlogged
    assert s.counters.counter("idle") == 0.0
    s.add_request(request("idle", 9.0))
    assert s.counters.counter("idle") == s.counters.counter("busy") > 0


def test_a_preempted_request_does_not_lift_its_tenant() -> None:
    counters = VirtualTokenCounters()
    queue = FairWaitingQueue(counters)
    queue.push(request("busy", 0.0))
    counters.charge_prompt("busy", 1.0, 100)  # busy is backlogged at 100, light at 0
    light = request("light", 1.0)
    queue.push_front(light)  # light's request returns, preempted: it was being served
    assert counters.counter("light") == 0.0
    assert queue.pop() is light
    queue.push(light)  # arriving anew from idle, it is lifted: it banks no credit
    assert counters.counter("light") == counters.counter("busy") == 100.0


def test_victims_are_the_heaviest_tenants_unless_the_setting_says_newest() -> None:
    light_new, heavy_old = request("light", 5.0), request("heavy", 1.0)
    fair = make_policy("fair", 256)
    fair.counters.charge_prompt("heavy", 1.0, 100)
    assert fair.choose_victim([light_new, heavy_old]) is heavy_old
    newest = make_policy("fair", 256, preempts_heavier=False)
    newest.counters.charge_prompt("heavy", 1.0, 100)
    assert newest.choose_victim([light_new, heavy_old]) is light_new


# --------------------------------------------------------- the engine, simulated runner
def served_while_backlogged(weights: dict[str, float], policy: str = "fair",
                            requests_each: int = 60, steps: int = 150) -> dict[str, int]:
    """Tokens served (prompt + generated) per tenant over `steps` engine steps while every
    tenant stays backlogged; the first tenant sends its requests first, all at once."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        runner="simulated", max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=256,
        scheduler_policy=policy))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for name, weight in weights.items():
        for _ in range(requests_each):
            engine.add_request([5] * 32, params, tenant=TenantShare(name, weight))
    served = dict.fromkeys(weights, 0)
    tenant_of = {r.request_id: r.tenant for r in engine.scheduler.unfinished_requests()}
    admitted: set[str] = set()
    for _ in range(steps):
        for request in engine.scheduler.running:
            if request.request_id not in admitted:
                admitted.add(request.request_id)
                served[request.tenant] += request.num_prompt_tokens
        for out in engine.step():
            served[tenant_of[out.request_id]] += len(out.new_token_ids)
        assert {r.tenant for r in engine.scheduler.waiting} == set(weights)  # backlogged
    return served


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def test_equal_weights_share_served_tokens_fairly() -> None:
    served = served_while_backlogged({"a": 1.0, "b": 1.0, "c": 1.0})
    assert jain(list(served.values())) >= 0.95
    unfair = served_while_backlogged({"a": 1.0, "b": 1.0, "c": 1.0}, policy="fcfs")
    assert jain(list(unfair.values())) < 0.5  # the check can fail: fcfs serves a's first


def test_shares_follow_weights_one_two_four_within_ten_percent() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    served = served_while_backlogged(weights)
    total = sum(served.values())
    for name, weight in weights.items():
        assert abs(served[name] / total - weight / 7.0) <= 0.1 * weight / 7.0, served


def test_one_tenant_alone_runs_in_fcfs_order() -> None:
    orders = {}
    for policy in ("fcfs", "fair"):
        s, runner = scheduler(max_num_seqs=2, policy=policy)
        for i in range(6):
            s.add_request(request("solo", float(i), prompt_len=4 + i))
        admitted: list[str] = []
        while s.has_unfinished_requests():
            step(s, runner)
            admitted += [r.prompt_token_ids.count(3) for r in s.running
                         if r.prompt_token_ids.count(3) not in admitted]
        orders[policy] = admitted
    assert len(orders["fcfs"]) == 6
    assert orders["fair"] == orders["fcfs"]
