"""Cache affinity over the replicas' own answers, and the one
IterserveRouter with its in-flight source injected: hand-made situations, no simulator."""

from __future__ import annotations

import random

import pytest
from router_oracle import rank_replicas

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_policy import Correction
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.iterserve_router import CALLER_VIEWS, OWN_TRACKER, IterserveRouter
from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext

NOW = 100.0
STICKY = RouterConfig(cache_affinity_threshold=0.1, cache_affinity_slack=2.0,
                      routed_work_weight=32.0)


def load(kv: float = 0.1, waiting: int = 0) -> ReplicaLoad:
    return ReplicaLoad(kv_usage=kv, num_waiting=waiting, num_running=1,
                       num_free_blocks=int(1000 * (1 - kv)), num_total_blocks=1000,
                       step_token_rate=0.0, timestamp=NOW - 0.2)


def test_prefix_holder_keeps_the_prompt_despite_the_long_run_balance() -> None:
    loads = {"a": load(), "b": load()}
    work = {"a": 40_000.0, "b": 0.0}  # a was sent far more (its tenant is popular)
    kw = dict(prompt_tokens=7000, cached_tokens={"a": 6000, "b": 0}, routed_work=work, now=NOW)
    # without the gate the balance term pulls the prompt off its prefix
    off = RouterConfig(routed_work_weight=32.0, cache_affinity_threshold=1.1)
    assert rank_replicas(["a", "b"], loads, {}, off, **kw)[0] == "b"
    assert rank_replicas(["a", "b"], loads, {}, STICKY, **kw)[0] == "a"


def test_prefix_holder_loses_when_its_queue_is_beyond_the_slack_or_it_is_hot() -> None:
    kw = dict(prompt_tokens=7000, cached_tokens={"a": 6000, "b": 0}, now=NOW)
    # a's 6000 cached tokens save 11.7 waiting-equivalents (512 tokens each): 30 waiting
    # there is beyond them plus the slack
    behind = {"a": load(waiting=30), "b": load()}
    assert rank_replicas(["a", "b"], behind, {}, STICKY, **kw)[0] == "b"
    hot = {"a": load(kv=0.95), "b": load()}
    assert rank_replicas(["a", "b"], hot, {}, STICKY, **kw)[0] == "b"


def test_a_share_below_the_threshold_is_left_to_the_score() -> None:
    loads = {"a": load(waiting=1), "b": load()}
    cfg = RouterConfig(cache_affinity_threshold=0.5, cache_affinity_slack=8.0)
    # a holds 30 % of the prompt: under the threshold, so the emptier b wins on score
    assert rank_replicas(["a", "b"], loads, {}, cfg, prompt_tokens=1000,
                         cached_tokens={"a": 300, "b": 0}, now=NOW)[0] == "b"


def test_a_prefix_just_sent_elsewhere_follows_the_affinity_table() -> None:
    loads = {"a": load(), "b": load(), "c": load()}
    kw = dict(prompt_prefix_hash=42, affinity={42: "c"}, prompt_tokens=7000,
              cached_tokens={"a": 0, "b": 0, "c": 0}, now=NOW)
    # nobody caches it yet (c computed it and evicted, or is about to): c, the last home
    assert rank_replicas(["a", "b", "c"], loads, {}, STICKY, **kw)[0] == "c"
    # the gate off (threshold above 1): the score decides, and the tie goes to a
    off = RouterConfig(cache_affinity_threshold=1.1)
    assert rank_replicas(["a", "b", "c"], loads, {}, off, **kw)[0] == "a"
    # c far behind (beyond the slack): load wins
    behind = {**loads, "c": load(waiting=STICKY.cache_affinity_slack + 1)}
    assert rank_replicas(["a", "b", "c"], behind, {}, STICKY, **kw)[0] == "a"


def _ctx(corrections: dict[str, Correction]) -> RoutingContext:
    views = [ReplicaView(r, load(), corrections.get(r, Correction(0))) for r in ("a", "b")]
    return RoutingContext(RouteRequest("q", (1,) * 64, 16, NOW), views, NOW, 16)


def test_one_router_class_with_its_in_flight_source_injected() -> None:
    cfg = RouterConfig(prefix_affinity=False, routed_work_weight=0.0)
    busy_a = {"a": Correction(6, 600, 600, 0)}  # the caller says: 6 unseen requests on a
    caller = IterserveRouter(cfg, in_flight=CALLER_VIEWS)
    assert all(caller.choose(_ctx(busy_a), random.Random(s)) == "b" for s in range(8))
    # its own tracker knows nothing of those 6: either replica may be chosen
    own = IterserveRouter(cfg, in_flight=OWN_TRACKER)
    assert {own.choose(_ctx(busy_a), random.Random(s)) for s in range(8)} == {"a", "b"}
    # ... and counts what it routed itself
    for i in range(6):
        own.on_routed(RouteRequest(f"r{i}", (1,) * 64, 16, NOW), "a", NOW)
    assert all(own.choose(_ctx({}), random.Random(s)) == "b" for s in range(8))
    with pytest.raises(ValueError):
        IterserveRouter(cfg, in_flight="shared")  # type: ignore[arg-type]
