"""While tenants contend, each one's prompts fill at most its weighted share of a step
(replica/prefill_shares.py); a tenant alone fills the whole budget as before."""

from __future__ import annotations

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.null_runner import NullRunner
from iterserve.replica.prefill_shares import step_prefill_shares
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.scheduling_policy import make_policy
from tests.unit.test_fair_share import request, scheduler


def test_shares_follow_weights_within_a_band_and_a_tenant_alone_is_not_capped() -> None:
    shares = step_prefill_shares([((0, "a"), 1.0), ((0, "b"), 3.0), ((1, "c"), 1.0)], 2048)
    assert shares is not None
    assert shares.tokens_left(request("a", 0.0), 2048) == 512
    assert shares.tokens_left(request("b", 0.0), 2048) == 1536
    assert shares.tokens_left(request("c", 0.0, priority=1), 2048) == 2048  # alone in band 1
    assert shares.tokens_left(request("a", 0.0), 100) == 100  # never past the budget left
    shares.spend(request("a", 0.0), 500)
    assert shares.tokens_left(request("a", 0.0), 2048) == 12
    assert step_prefill_shares([((0, "a"), 1.0), ((1, "b"), 1.0)], 2048) is None


def prefill_tokens_by_tenant(s: Scheduler, runner: NullRunner) -> dict[str, int]:
    """The tokens each tenant computes in the next step (decodes included), run."""
    output = s.schedule()
    tokens: dict[str, int] = {}
    for planned in output.scheduled:
        tenant = planned.request.tenant
        tokens[tenant] = tokens.get(tenant, 0) + planned.num_new_tokens
    s.update(output, runner.execute(output))
    return tokens


def test_a_backlogged_tenant_takes_half_the_step_while_another_tenant_is_present() -> None:
    # Budget 64; heavy has four 32-token prompts, light one 8-token prompt, all waiting.
    s, runner = scheduler(max_num_seqs=8)
    for arrival in range(4):
        s.add_request(request("heavy", float(arrival), prompt_len=32))
    s.add_request(request("light", 9.0, prompt_len=8))
    assert prefill_tokens_by_tenant(s, runner) == {"light": 8}  # its short step
    # light decodes (one token): heavy's prompts are held to 64 / 2 tokens a step
    assert prefill_tokens_by_tenant(s, runner) == {"light": 1, "heavy": 32}


def test_a_tenant_alone_fills_the_whole_budget() -> None:
    s, runner = scheduler(max_num_seqs=8)
    for arrival in range(4):
        s.add_request(request("only", float(arrival), prompt_len=32))
    assert prefill_tokens_by_tenant(s, runner) == {"only": 64}


def test_off_the_backlogged_tenant_fills_the_step_again() -> None:
    """The check above can fail: without the share heavy fills what light leaves."""
    s, runner = scheduler(max_num_seqs=8, fair_prefill_share=False)
    for arrival in range(4):
        s.add_request(request("heavy", float(arrival), prompt_len=32))
    s.add_request(request("light", 9.0, prompt_len=8))
    prefill_tokens_by_tenant(s, runner)
    assert prefill_tokens_by_tenant(s, runner) == {"light": 1, "heavy": 63}


def test_without_chunked_prefill_nothing_is_capped() -> None:
    """A prompt longer than its share could never run unchunked: the share stays off."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                                  enable_chunked_prefill=False, scheduler_policy="fair"),
                  BlockManager(64, 4, enable_prefix_caching=False))
    running = [request("a", 0.0), request("b", 1.0)]
    chunked = make_policy("fair", 256)
    for policy in (s.policy, chunked):
        for r in running:  # as their admission did
            policy.counters.charge_prompt(r.tenant, r.tenant_weight, r.num_prompt_tokens)
    assert s.policy.prefill_shares(running, 256) is None
    assert chunked.prefill_shares(running, 256) is not None
