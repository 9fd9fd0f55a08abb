"""Draining the unseen sends' prefill (RouterConfig.drain_inflight_prefill): the replicas'
measured prefill_token_rate, the tracker's fluid queue, and what the router ranks with it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from router_oracle import queued_prefill

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_inflight import Correction, InFlightTracker
from iterserve.autoscale.router_policy import effective_load, prefill_queue
from iterserve.autoscale.router_state import KVRouterCore
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica import EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.prefill_rate import RATE_WINDOW_S, PrefillRateMeter

RATE = 1000.0  # prompt tokens per second


DRAIN = RouterConfig(drain_inflight_prefill=True)
NO_DRAIN = RouterConfig(drain_inflight_prefill=False)


def _load(timestamp: float, rate: float = RATE, queued: int = 0) -> ReplicaLoad:
    return ReplicaLoad(kv_usage=0.0, num_waiting=0, num_running=0, num_free_blocks=1000,
                       num_total_blocks=1000, step_token_rate=0.0, timestamp=timestamp,
                       prefill_token_rate=rate, queued_prefill_tokens=queued)


def _tracker(drain: bool) -> InFlightTracker[str]:
    tracker: InFlightTracker[str] = InFlightTracker(drain_prefill=drain)
    tracker.routed("seen", "a", 9.9, prompt_tokens=900, prefill_tokens=900)  # before the stats
    tracker.routed("q1", "a", 10.1, prompt_tokens=600, prefill_tokens=500)
    tracker.routed("q2", "a", 10.3, prompt_tokens=500, prefill_tokens=400)
    tracker.routed("q3", "a", 10.35, prompt_tokens=200, prefill_tokens=100)
    return tracker


def test_the_unseen_sends_form_a_queue_that_drains_at_the_replicas_rate() -> None:
    # 500 at 10.1; 200 ms later 300 are left, + 400; 50 ms later 650, + 100 = 750 at 10.35
    correction = _tracker(drain=True).correction("a", _load(10.0))
    assert correction is not None
    assert correction.requests == 3 and correction.prompt_tokens == 1300
    assert correction.prefill_tokens == pytest.approx(750.0)
    assert correction.prefill_as_of == 10.35
    load = _load(10.0)
    assert queued_prefill(correction, load, 10.85, DRAIN) == pytest.approx(250.0)
    assert queued_prefill(correction, load, 11.5, DRAIN) == 0.0
    assert queued_prefill(correction, load, 10.0, DRAIN) == pytest.approx(750.0)  # behind


def test_the_queue_starts_from_what_the_replica_reported_queued_at_its_stats() -> None:
    # 3,000 queued at 10.0: 2,900 left at 10.1, + 500; 3,200 at 10.3, + 400; 3,550 + 100
    load = _load(10.0, queued=3000)
    correction = _tracker(drain=True).correction("a", load)
    assert correction is not None and correction.prefill_tokens == pytest.approx(3650.0)
    # no unseen send: the report alone, drained from its time (charged only when draining)
    idle = Correction(0)
    assert prefill_queue(idle, load, DRAIN) == (3000, 10.0)
    assert queued_prefill(idle, load, 11.0, DRAIN) == pytest.approx(2000.0)
    assert queued_prefill(idle, load, 11.0, NO_DRAIN) == 0


def test_without_drain_or_a_rate_every_unseen_send_counts_in_full() -> None:
    plain = _tracker(drain=False).correction("a", _load(10.0))
    no_rate = _tracker(drain=True).correction("a", _load(10.0, rate=0.0))
    for correction in (plain, no_rate):
        assert correction is not None
        assert correction.prefill_tokens == 1000 and correction.prefill_as_of is None
        assert queued_prefill(correction, _load(10.0), 99.0, NO_DRAIN) == 1000
    assert no_rate is not None
    assert queued_prefill(no_rate, _load(10.0, rate=0.0), 99.0, DRAIN) == 1000


def test_with_drain_waiting_only_the_sends_still_queued_count_as_waiting() -> None:
    def tracker() -> InFlightTracker[str]:
        sends: InFlightTracker[str] = InFlightTracker(drain_prefill=True, drain_waiting=True)
        for request_id, at, prefill in (("q1", 10.1, 500), ("q2", 10.3, 400),
                                        ("q3", 10.35, 100)):
            sends.routed(request_id, "a", at, prompt_tokens=prefill + 100,
                         prefill_tokens=prefill)
        return sends

    # at 5,000 tokens/s: q1's 500 are done by 10.3; q2's 400 have 150 left at 10.35, q3 waits
    load = dataclasses.replace(_load(10.0, rate=5000.0), num_waiting=1)
    correction = tracker().correction("a", load)
    assert correction is not None and (correction.requests, correction.waiting) == (3, 2)
    assert correction.prefill_tokens == pytest.approx(250.0)
    assert effective_load(load, correction, 10.4, DRAIN)[0] == 1 + 2
    # behind 3,000 tokens the replica reported queued, every send still waits
    queued = tracker().correction("a", _load(10.0, rate=5000.0, queued=3000))
    assert queued is not None and queued.waiting == 3
    # off (the default), every unseen send counts until the replica's next stats
    counted = _tracker(drain=True).correction("a", _load(10.0, rate=5000.0))
    assert counted is not None and counted.waiting is None
    assert effective_load(load, counted, 10.4, DRAIN)[0] == 1 + 3


def test_drain_waiting_needs_the_drained_prefill_queue() -> None:
    with pytest.raises(ValueError, match="drain_prefill"):
        InFlightTracker(drain_prefill=False, drain_waiting=True)
    with pytest.raises(ValueError, match="drain_inflight_prefill"):
        RouterConfig(drain_inflight_prefill=False, drain_inflight_waiting=True)
    core: KVRouterCore[str] = KVRouterCore(RouterConfig(drain_inflight_waiting=True))
    assert core.in_flight.drain_waiting


def test_a_drained_replica_is_no_longer_charged_for_what_it_has_prefilled() -> None:
    """The herding case: replica a reported 0.4 s ago and was sent 2,000 prompt tokens
    0.35 s ago (long prefilled at 35k tokens/s); b reported 10 ms ago and was sent as many
    5 ms ago (mostly still queued). Undrained the two look alike and the candidate order
    (b first) decides; drained, a is charged only what is left of its prefill: nothing."""
    now = 10.4
    loads = [_load(now - 0.01, rate=35_000.0), _load(now - 0.4, rate=35_000.0)]
    for drain, want in ((False, "b"), (True, "a")):
        config = RouterConfig(drain_inflight_prefill=drain, routed_work_weight=0.0)
        core: KVRouterCore[str] = KVRouterCore(config)
        core.routed("old", "a", now - 0.35, None, 2100, prefill_tokens=2000)
        core.routed("new", "b", now - 0.005, None, 2100, prefill_tokens=2000)
        assert core.best(["b", "a"], loads, None, 600, now, prompt_tokens=500) == want
        assert core.rank(["b", "a"], loads, None, 600, now, prompt_tokens=500)[0] == want


def test_prefill_token_rate_is_on_the_wire_and_validated() -> None:
    load = _load(5.0, rate=12_345.5)
    wire = json.loads(json.dumps(load.to_dict()))
    assert wire["prefill_token_rate"] == 12_345.5
    assert ReplicaLoad.from_dict(wire) == load
    del wire["prefill_token_rate"]  # an older replica: not measured
    assert ReplicaLoad.from_dict(wire).prefill_token_rate == 0.0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="prefill_token_rate"):
            _load(5.0, rate=bad)
    with pytest.raises(ValueError, match="queued_prefill_tokens"):
        _load(5.0, queued=-1)


def test_the_prefill_rate_is_tokens_per_step_second_over_the_window() -> None:
    meter = PrefillRateMeter()
    assert meter.rate(0.0) == 0.0
    meter.record(1.0, 300, 0.1)
    meter.record(1.5, 0, 0.2)  # a decode-only step: not a sample
    meter.record(1.6, 100, 0.0)  # no measurable time: not a sample
    meter.record(2.0, 500, 0.3)
    # idle time between the steps does not dilute it: 800 tokens over 0.4 step seconds
    assert meter.rate(2.5) == pytest.approx(800 / 0.4)
    assert meter.rate(1.0 + RATE_WINDOW_S + 0.01) == pytest.approx(500 / 0.3)  # first out
    assert meter.samples() == [(2.0, 500, 0.3)]
    assert meter.rate(2.0 + RATE_WINDOW_S + 0.01) == 0.0


def test_the_simulated_replica_reports_its_cost_models_prefill_rate() -> None:
    from iterserve.autoscale.sim.simulated_replica import SimulatedReplica

    config = ClusterSimConfig()
    replica = SimulatedReplica("r0", config, 0.0)
    assert replica.load(0.0).prefill_token_rate == 0.0  # nothing prefilled yet
    prompt = list(range(1, 1001))
    replica.add(WorkloadRequest("q", 0.0, tuple(prompt), 4, output_token_id=7), 0.0)
    step = config.sim.cost.step_time(1000, 0, 1000)  # one step prefills the whole prompt
    assert replica.load(step).prefill_token_rate == pytest.approx(1000 / step)
    assert replica.load(step + 5.0).prefill_token_rate == 0.0  # out of the 2 s window


def test_the_engine_measures_its_prefill_rate_over_the_steps_that_prefilled() -> None:
    config = EngineConfig.from_kwargs(runner="simulated", max_model_len=2048)
    engine = LLMEngine(config)
    assert engine.stats().prefill_token_rate == 0.0
    engine.add_request(list(range(1, 301)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    rate = engine.stats().prefill_token_rate
    assert rate > 0.0
    # no faster than its prompt over the one step that prefilled it could allow
    assert rate == pytest.approx(300 / engine.prefill_rate.samples()[0][2])
    assert ReplicaLoad.from_engine_stats(engine.stats()).prefill_token_rate == rate
    assert engine.stats().queued_prefill_tokens == 0  # all computed


def test_the_schedulers_queued_prefill_counts_uncomputed_prompt_tokens() -> None:
    config = EngineConfig.from_kwargs(runner="simulated", max_model_len=2048,
                                      max_num_batched_tokens=256, max_num_seqs=1)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request(list(range(1, 1001)), params)
    engine.add_request(list(range(1, 101)), params)
    assert engine.stats().queued_prefill_tokens == 1100
    engine.step()  # one 256-token chunk of the first; the second waits (max_num_seqs 1)
    assert engine.stats().queued_prefill_tokens == 1100 - 256
    load = ReplicaLoad.from_engine_stats(engine.stats())
    assert ReplicaLoad.from_dict(json.loads(json.dumps(load.to_dict()))) == load
