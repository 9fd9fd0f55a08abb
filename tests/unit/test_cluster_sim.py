"""The cluster simulator: determinism, fast-forward == step-by-step, Serve's mechanics."""

from __future__ import annotations

import random

import numpy as np
import pytest

from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.percentile import percentile, percentile_of_counts
from iterserve.autoscale.router_policy import InFlightTracker
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.cluster import RouterState, simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.policies import (
    FixedReplicas,
    IterserveAutoscaler,
    IterserveRouter,
)
from iterserve.autoscale.sim.results import SimResult
from iterserve.autoscale.sim.workload import WorkloadRequest


def make_workload(n: int, rate: float, seed: int = 0, num_prefixes: int = 4,
                  prompt: tuple[int, int] = (40, 600), output: tuple[int, int] = (8, 200),
                  start: float = 0.0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(10, 4000) for _ in range(128)) for _ in range(num_prefixes)]
    t, out = start, []
    for i in range(n):
        t += rng.expovariate(rate)
        own = tuple(rng.randrange(10, 4000) for _ in range(rng.randint(*prompt)))
        ids = (prefixes[rng.randrange(num_prefixes)] + own) if num_prefixes else own
        out.append(WorkloadRequest(f"r{seed}-{i}", t, ids, rng.randint(*output),
                              output_token_id=rng.randrange(10, 4000)))
    return out


SMALL = ClusterSimConfig(num_blocks=400, max_num_seqs=32, max_num_batched_tokens=512,
                         max_model_len=2048)


def test_same_seed_gives_byte_identical_results() -> None:
    workload = make_workload(300, rate=30.0)
    runs = [simulate(workload, [IterserveRouter(), IterserveRouter()], 3, SMALL).to_json()
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = simulate(workload, [IterserveRouter(), IterserveRouter()], 3,
                     ClusterSimConfig(**{**SMALL.__dict__, "seed": 1})).to_json()
    assert other != runs[0]  # the seed reaches the routers' tie-breaking and poll phases


@pytest.mark.parametrize("num_blocks", [120, 400, 5000])
def test_fast_forward_equals_step_by_step(num_blocks: int) -> None:
    """Block pressure (120: preemptions), prefix sharing, two routers and an autoscaler."""
    workload = make_workload(250, rate=25.0, seed=3)
    results = []
    for fast in (True, False):
        config = ClusterSimConfig(**{**SMALL.__dict__, "num_blocks": num_blocks,
                                     "fast_forward": fast, "startup_delay_s": 2.0})
        scaler = IterserveAutoscaler(AutoscaleConfig(min_replicas=1, max_replicas=4,
                                                     downscale_delay_s=3.0))
        results.append(simulate(workload, [IterserveRouter(), IterserveRouter()], 1, config,
                                scaler))
    fast, slow = results
    assert fast.to_json() == slow.to_json()
    assert fast.num_finished == len(workload)
    if num_blocks == 120:
        assert sum(r.preemptions for r in fast.records) > 0
    assert fast.prefix_hit_tokens > 0


def test_fast_forward_skips_most_scheduler_calls() -> None:
    workload = make_workload(40, rate=200.0, output=(300, 400), num_prefixes=0)
    config = ClusterSimConfig(**{**SMALL.__dict__, "num_blocks": 5000})
    result = simulate(workload, [IterserveRouter()], 1, config)
    assert result.num_finished == 40
    assert all(r.output_tokens == r.max_tokens for r in result.records)
    assert all(r.itl_max < 0.1 for r in result.records)


def test_router_corrections_match_inflight_tracker() -> None:
    rng = random.Random(0)
    state = RouterState(0, IterserveRouter(), random.Random(0))
    tracker: InFlightTracker[str] = InFlightTracker()
    loads: dict[str, ReplicaLoad | None] = {"a": None, "b": None}
    live: list[tuple[str, str, int]] = []
    now = 0.0
    for i in range(400):
        now += 0.01
        action = rng.random()
        if action < 0.5:
            rid, tokens = rng.choice("ab"), rng.randint(1, 500)
            state.routed(rid, f"q{i}", tokens)
            tracker.routed(f"q{i}", rid, now, tokens)
            live.append((rid, f"q{i}", tokens))
        elif action < 0.8 and live:
            rid, qid, tokens = live.pop(rng.randrange(len(live)))
            state.completed(rid, qid, tokens)
            tracker.completed(qid)
        else:  # a stats poll of one replica
            rid = rng.choice("ab")
            loads[rid] = ReplicaLoad(0.1, 0, 0, 10, 10, 0.0, timestamp=now)
            state.stats_published(rid)
        expected = tracker.corrections(loads)
        for rid in "ab":
            got = state.correction(rid)
            want = expected.get(rid)
            assert (got.requests, got.prompt_tokens, got.committed_tokens) == (
                (0, 0, 0) if want is None else
                (want.requests, want.prompt_tokens, want.committed_tokens))


def test_autoscaler_scales_up_after_startup_delay_and_drains_down() -> None:
    burst = make_workload(600, rate=60.0, seed=5, output=(100, 300))
    burst += make_workload(30, rate=0.5, seed=6, start=burst[-1].arrival_time + 60)  # quiet tail
    config = ClusterSimConfig(**{**SMALL.__dict__, "startup_delay_s": 5.0})
    scaler = IterserveAutoscaler(AutoscaleConfig(min_replicas=1, max_replicas=6,
                                                 downscale_delay_s=2.0))
    result = simulate(burst, [IterserveRouter()], 1, config, scaler)
    assert result.num_finished == len(burst)
    counts = result.replicas_over_time
    assert max(running for _, running, _, _ in counts) > 1
    first_start = next(t for t, _, starting, _ in counts if starting > 0)
    first_ready = next(t for t, running, _, _ in counts if running > 1)
    assert first_ready - first_start == pytest.approx(5.0)
    assert counts[-1][1] < max(running for _, running, _, _ in counts)  # scaled back down
    assert result.gpu_seconds > result.end_time  # more than one replica for a while


def test_max_ongoing_requests_holds_requests_at_the_router() -> None:
    workload = make_workload(50, rate=1000.0, output=(50, 60), num_prefixes=0)
    config = ClusterSimConfig(**{**SMALL.__dict__, "max_ongoing_requests": 4})
    result = simulate(workload, [IterserveRouter()], 2, config)
    assert result.num_finished == 50
    late = [r for r in result.records if r.routed - r.arrival > 0.05]
    assert late  # waited at the router for a free slot
    fixed = simulate(workload, [IterserveRouter()], 2, config, FixedReplicas(2))
    assert fixed.autoscaler_name == "fixed-2"


def test_router_must_choose_an_offered_replica() -> None:
    class Bad:
        name = "bad"

        def choose(self, ctx: object, rng: random.Random) -> str:
            return "nowhere"

        def on_routed(self, *args: object) -> None: ...
        def on_completed(self, *args: object) -> None: ...
        def on_replicas_changed(self, *args: object) -> None: ...

    with pytest.raises(ValueError, match="not one of"):
        simulate(make_workload(3, rate=1.0), [Bad()], 1, SMALL)


def test_percentile_is_numpy_linear() -> None:
    rng = random.Random(1)
    values = [rng.random() for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    counts = {0.1: 5, 0.2: 1, 0.5: 3}
    expanded = [0.1] * 5 + [0.2] + [0.5] * 3
    for q in (0, 10, 50, 60, 99, 100):
        assert percentile_of_counts(counts, q) == pytest.approx(float(np.percentile(expanded, q)))


def test_results_do_not_depend_on_the_process_hash_seed() -> None:
    """Byte-identical across processes (Python salts str hashes per process)."""
    import subprocess
    import sys

    script = (
        "import hashlib\n"
        "from iterserve.autoscale.sim.cluster import simulate\n"
        "from iterserve.autoscale.sim.policies import IterserveRouter\n"
        "from iterserve.autoscale.sim.config import ClusterSimConfig\n"
        "from iterserve.autoscale.sim.shapes import make\n"
        "r = simulate(make('multi-turn', 10.0, 20.0), [IterserveRouter(), IterserveRouter()],"
        " 2, ClusterSimConfig(num_blocks=2000))\n"
        "print(hashlib.sha256(r.to_json().encode()).hexdigest())\n")
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, env={"PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    assert len(digests) == 1


def test_a_request_that_can_never_fit_is_rejected_and_the_rest_finish() -> None:
    workload = make_workload(20, rate=10.0, num_prefixes=0)
    too_long = WorkloadRequest("huge", 0.5, tuple(range(100, 3100)), 10)  # > max_model_len 2048
    result = simulate(sorted(workload + [too_long], key=lambda r: r.arrival_time),
                      [IterserveRouter()], 1, SMALL)
    huge = next(r for r in result.records if r.request_id == "huge")
    assert huge.replica is None and huge.first_token is None
    assert result.num_finished == 20


def test_scale_from_zero_when_requests_wait() -> None:
    quiet_then_busy = make_workload(20, rate=0.05, num_prefixes=0, output=(8, 16))
    config = ClusterSimConfig(**{**SMALL.__dict__, "startup_delay_s": 1.0})
    scaler = IterserveAutoscaler(AutoscaleConfig(min_replicas=0, max_replicas=2,
                                                 downscale_delay_s=1.0))
    result = simulate(quiet_then_busy, [IterserveRouter()], 1, config, scaler)
    assert result.num_finished == 20
    assert min(running for _, running, _, _ in result.replicas_over_time) == 0


def test_engine_waits_lengthen_steps_deterministically_and_alike_on_both_paths() -> None:
    """A wait drawn before each continuing step (sim_validation --engine-cpu
    measured-waits): same JSON on the fast path and step by step, the same again on a
    rerun, nothing changed by a distribution of zeros (its own RNG stream), TTFT longer."""
    from iterserve.replica.device_idle import WaitDistribution

    workload = make_workload(200, rate=25.0, seed=5)
    waits = WaitDistribution((0.0005, 0.002, 0.05), (0.6, 0.39, 0.01), 0.0001, 4.0)

    def run(engine_waits: WaitDistribution | None, fast: bool = True) -> SimResult:
        config = ClusterSimConfig(**{**SMALL.__dict__, "engine_waits": engine_waits,
                                     "fast_forward": fast})
        return simulate(workload, [IterserveRouter()], 2, config)

    with_waits = run(waits)
    assert with_waits.to_json() == run(waits).to_json() == run(waits, fast=False).to_json()
    without = run(None)
    assert run(WaitDistribution((0.0,), (1.0,))).to_json() == without.to_json()
    assert with_waits.num_finished == without.num_finished == len(workload)
    assert with_waits.ttft_percentile(50) > without.ttft_percentile(50)


@pytest.mark.parametrize(("workload", "rate", "num_blocks", "fast"), [
    ("skewed-bursts", 60.0, 260, True), ("skewed-bursts", 60.0, 260, False),
    ("multi-tenant", 20.0, 2000, True), ("steady", 60.0, 5000, True)])
def test_private_blocks_hashed_lazily_give_the_same_results(workload: str, rate: float,
                                                            num_blocks: int, fast: bool) -> None:
    """SimBlockManager.mark_private (a private SyntheticPrompt's own blocks are hashed only if
    it is preempted): byte-identical JSON with and without it, under block pressure
    (preemptions, whose readmissions find their own blocks), shared heads and prefix hits,
    on the fast path and step by step."""
    from iterserve.autoscale.sim.shapes import make

    requests = make(workload, rate, 6.0, seed=2)
    assert all(r.prompt_token_ids.private for r in requests)
    results = []
    for lazy in (True, False):
        config = ClusterSimConfig(**{**SMALL.__dict__, "num_blocks": num_blocks,
                                     "max_model_len": 8192, "fast_forward": fast,
                                     "lazy_private_blocks": lazy})
        results.append(simulate(requests, [IterserveRouter(), IterserveRouter()], 2, config))
    lazy_result, eager = results
    assert lazy_result.to_json() == eager.to_json()
    assert lazy_result.num_finished == len(requests)
    if num_blocks < 5000:
        assert sum(r.preemptions for r in lazy_result.records) > 0
        assert lazy_result.prefix_hit_tokens > 0


@pytest.mark.parametrize("private", [False, True])
def test_stats_count_no_prefill_left_for_a_decode_that_joined_one_prompt_token_short(
        private: bool) -> None:
    """A chunk that stops one token short of the prompt's end makes the request a decode
    whose next step computes that token: from then on a stats report counts no prefill
    left for it, on the fast path as step by step (its lazily kept fields are synced)."""
    from iterserve.autoscale.sim.prompts import SyntheticPrompt
    from iterserve.autoscale.sim.simulated_replica import SimulatedReplica

    prompt = SyntheticPrompt((), 1 << 31, 513, private=private)  # a chunk of 512, then 1
    spec = WorkloadRequest("r", 0.0, prompt, 64)
    queued = []
    for fast in (True, False):
        config = ClusterSimConfig(**{**SMALL.__dict__, "num_blocks": 400, "fast_forward": fast})
        replica = SimulatedReplica("replica-0", config, 0.0)
        replica.add(spec, 0.0)
        seen = []
        while replica.wake_time is not None and len(seen) < 10:
            seen.append(replica.load(replica.wake_time).queued_prefill_tokens)
        queued.append(seen)
    assert queued[0] == queued[1]
    assert queued[0][0] == 1 and queued[0][1:] == [0] * 9


def test_a_rejected_private_request_leaves_no_mark() -> None:
    from iterserve.autoscale.sim.prompts import SyntheticPrompt
    from iterserve.autoscale.sim.simulated_replica import SimulatedReplica

    config = ClusterSimConfig(**{**SMALL.__dict__, "num_blocks": 400})
    replica = SimulatedReplica("replica-0", config, 0.0)
    too_long = WorkloadRequest("big", 0.0, SyntheticPrompt((), 1 << 31, 4000, private=True), 8)
    with pytest.raises(ValueError):
        replica.add(too_long, 0.0)
    assert not replica.block_manager.private_from
    replica.add(WorkloadRequest("ok", 0.0, SyntheticPrompt((), 1 << 30, 40, private=True), 8), 0.0)
    assert replica.block_manager.private_from == {"ok": 0}
