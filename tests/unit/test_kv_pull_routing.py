"""The router's side of prefix pulls (autoscale/router.py), built by hand with no Ray
processes: a generate call is told which replica holds its prompt's longest prefix, and a call
naming a replica in `route_to_replica` reaches that replica alone. And the pull's cost rule
(autoscale/kv_pull_cost.py), which the ranking uses to price a pull (autoscale/pull_pricing.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from block_hash_oracle import prompt_block_hashes
from test_router_cache_reports import BLOCK, PROMPT, _FakeReplica, _pending, _router, load

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.kv_pull_cost import BandwidthMeter, pull_beats_compute
from iterserve.autoscale.route_target_gone import RouteTargetGone
from iterserve.autoscale.router import PULL_HINT_KWARG, ROUTE_TO_KWARG
from iterserve.deploy.kv_pull import PullHint


def _replicas() -> list[_FakeReplica]:
    holder = _FakeReplica("holder", load(prompt_block_hashes(PROMPT, BLOCK)).to_dict())
    return [holder, _FakeReplica("other", load([]).to_dict())]


def _generate_call(prompt: list[int], rid: str, **kwargs: object):  # noqa: ANN202
    pending = _pending(prompt, rid)
    pending.metadata.call_method = "generate"
    pending.kwargs.update(kwargs)
    return pending


def test_a_generate_call_is_told_which_replica_holds_its_prefix() -> None:
    router, replicas = _router(kv_pull_hints=True), _replicas()
    pending = _generate_call(PROMPT, "r1")
    asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.kwargs[PULL_HINT_KWARG] == ("holder", 40 * BLOCK)
    assert PullHint.parse(pending.kwargs[PULL_HINT_KWARG]) == PullHint("holder", 40 * BLOCK)
    assert PullHint.parse(["holder", "many"]) is None
    other_call = _pending(PROMPT, "r2")  # not a generate call: no hint
    asyncio.run(router.choose_replicas(replicas, other_call))
    assert PULL_HINT_KWARG not in other_call.kwargs
    quiet = _router()  # hints off (kv_pull off): nothing written
    pending = _generate_call(PROMPT, "r3")
    asyncio.run(quiet.choose_replicas(replicas, pending))
    assert PULL_HINT_KWARG not in pending.kwargs


def test_a_call_routed_to_a_replica_reaches_it_alone_or_nothing() -> None:
    router, replicas = _router(kv_pull_hints=True), _replicas()
    for target in ("other", "holder"):
        pending = _generate_call(PROMPT, f"to-{target}", **{ROUTE_TO_KWARG: target})
        ranks = asyncio.run(router.choose_replicas(replicas, pending))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [[target]]
        assert pending.kwargs[PULL_HINT_KWARG] == ("holder", 40 * BLOCK)


def test_a_call_routed_to_a_replica_that_is_gone_fails_at_once() -> None:
    """Through Serve's own routing loop (RequestRouter._choose_replica_for_request, what a
    handle call awaits): a call naming a replica that is not running fails with
    RouteTargetGone within a second. Before, Serve retried it with backoff until its caller
    gave up: a pull from a dead holder waited out the whole --kv-pull-timeout-s."""

    async def route(target: str) -> str:
        router, replicas = _router(kv_pull_hints=True), _replicas()
        router.update_replicas(replicas)
        pending = _generate_call(PROMPT, f"to-{target}", **{ROUTE_TO_KWARG: target})
        pending.reset_future()  # a future on this test's loop, as Serve makes one
        chosen = await asyncio.wait_for(router._choose_replica_for_request(pending), 1.0)
        assert not router._pending_requests_by_id  # nothing left behind in Serve's index
        return chosen.replica_id.unique_id

    assert asyncio.run(route("holder")) == "holder"
    with pytest.raises(RouteTargetGone, match="a-dead-replica"):
        asyncio.run(route("a-dead-replica"))


def test_a_pull_pays_when_its_bytes_move_faster_than_the_tokens_compute() -> None:
    # 1000 tokens of SmolLM2's fp32 KV (46 KB each) at 1 GB/s: 0.02 + 0.046 s
    assert pull_beats_compute(1000, 46_000_000, 1e9, prefill_tokens_per_s=2000.0)
    assert not pull_beats_compute(1000, 46_000_000, 1e9, prefill_tokens_per_s=50_000.0)
    assert pull_beats_compute(16, 1000, 1e9, prefill_tokens_per_s=None)  # not measured: try
    assert not pull_beats_compute(0, 0, 1e9, prefill_tokens_per_s=None)
    meter = BandwidthMeter(bytes_per_s=1e9)
    meter.record(100_000_000, 0.02 + 1.0)  # 100 MB moved in 1 s beyond the latency
    assert 1e8 < meter.bytes_per_s < 1e9
    before = meter.bytes_per_s
    meter.record(10, 0.001)  # quicker than the fixed latency: says nothing about bandwidth
    assert meter.bytes_per_s == before


def test_kv_pull_settings_reach_the_router_and_the_replicas_or_are_refused() -> None:
    from iterserve.deploy.app import build_app, resolve_app
    from iterserve.deploy.kv_pull import KVPullConfig

    args = {"model": "iterserve-tiny", "kv_offloading_size": 0.01, "kv_pull": "on",
            "kv_pull_max_bytes": 2**20, "kv_pull_timeout_s": 0.5}
    settings = resolve_app(args)
    assert settings.router.kv_pull_hints
    replica = build_app(args)._bound_deployment.init_args[0]._bound_deployment
    assert replica.init_args[3] == KVPullConfig("on", 2**20, 0.5)
    assert not resolve_app({"model": "iterserve-tiny"}).router.kv_pull_hints
    with pytest.raises(ValueError, match="kv_offloading_size"):
        resolve_app({"model": "iterserve-tiny", "kv_pull": "on"})
    with pytest.raises(ValueError, match="router"):
        resolve_app({**args, "router": "pow2"})
    with pytest.raises(ValueError):
        resolve_app({**args, "kv_pull": "sometimes"})


def test_serve_refuses_pulls_that_cannot_fit_its_object_store(capsys: pytest.CaptureFixture
                                                               ) -> None:
    from iterserve.deploy import cli_serve

    argv = ["--model", "iterserve-tiny", "--kv-offloading-size", "0.01", "--kv-pull", "on",
            "--kv-pull-max-bytes", str(200 * 2**20)]
    assert cli_serve.run(argv) == 2  # before Ray starts: the default store is 256 MiB
    assert "does not fit twice in --object-store-memory" in capsys.readouterr().err


def _busy(hashes: list[int], waiting: int) -> dict:
    from iterserve.autoscale.signals import ReplicaLoad

    plain = ReplicaLoad(kv_usage=0.3, num_waiting=waiting, num_running=4, num_free_blocks=700,
                        num_total_blocks=1000, step_token_rate=0.0, timestamp=time.time(),
                        prefill_token_rate=2000.0)
    return plain.with_cached_blocks(hashes, BLOCK).to_dict()


def _first_choice(waiting: int, **config: object) -> str:
    router = _router(**config)
    replicas = [_FakeReplica("holder", _busy(prompt_block_hashes(PROMPT, BLOCK), waiting)),
                _FakeReplica("idle", _busy([], 0))]
    ranks = asyncio.run(router.choose_replicas(replicas, _generate_call(PROMPT, "r")))
    return ranks[0][0].replica_id.unique_id


def test_the_live_router_prices_a_pull_from_a_busy_holder() -> None:
    """With pulls on, an idle replica is worth what it would save by pulling the prompt
    from the holder (kv_pull_cost.credit_pulls, the simulator's rule): a holder 4 requests
    deep loses the request to it, while pulls off (the prefix charged as a recompute there)
    keep it on the holder; a holder with nothing waiting keeps it either way."""
    smollm2 = {"kv_bytes_per_token": 46080}  # 640 tokens: 29 MB, 79 ms at 500 MB/s vs 320 ms
    assert _first_choice(4, kv_pull_hints=False, **smollm2) == "holder"
    assert _first_choice(4, kv_pull_hints=True, **smollm2) == "idle"
    assert _first_choice(0, kv_pull_hints=True, **smollm2) == "holder"
    # A pull slower than the prefill it saves (4 MB a token: 5 s) earns no credit.
    assert _first_choice(4, kv_pull_hints=True, kv_bytes_per_token=4_000_000) == "holder"


def test_pull_credit_is_the_saving_and_the_hint_the_tokens_a_holder_can_send() -> None:
    from iterserve.autoscale.pull_pricing import with_pull_credit
    from iterserve.autoscale.signals import ReplicaLoad

    config = RouterConfig(kv_bytes_per_token=46080, prefill_tokens_per_s=2000.0)
    loads: dict[str, ReplicaLoad | None] = {"holder": None, "idle": None}
    # holder: 400 on the device, 240 in its host tier (charged 600 by the tier costs)
    credited = with_pull_credit({"holder": 600}, {"holder": [400, 240, 0], "idle": [0, 0, 0]},
                                ["holder", "idle"], loads, config)
    pull_s = 0.02 + 640 * 46080 / 500e6
    assert credited["holder"] == 600
    assert credited["idle"] == round(640 * (1 - pull_s / (640 / 2000.0)))
    router = _router(kv_pull_hints=True, kv_bytes_per_token=46080)
    pending = _generate_call(PROMPT, "hint")
    asyncio.run(router.choose_replicas(_replicas(), pending))
    assert pending.kwargs[PULL_HINT_KWARG] == ("holder", 40 * BLOCK)  # tokens, not credit


def test_a_pull_is_priced_by_the_receivers_reported_kv_bytes() -> None:
    """The receiver's report, not the config's assumption: a model with 8x the bytes a
    token earns no credit where the assumed size would have."""
    from dataclasses import replace

    from iterserve.autoscale.pull_pricing import with_pull_credit
    from iterserve.autoscale.signals import ReplicaLoad

    config = RouterConfig(kv_bytes_per_token=46080, prefill_tokens_per_s=2000.0)
    base = ReplicaLoad(kv_usage=0.0, num_waiting=0, num_running=0, num_free_blocks=10,
                       num_total_blocks=10, step_token_rate=0.0, timestamp=0.0)
    tiers = {"holder": [640, 0, 0], "idle": [0, 0, 0]}
    assumed = with_pull_credit({"holder": 640}, tiers, ["holder", "idle"],
                               {"holder": None, "idle": base}, config)
    heavy = replace(base, kv_bytes_per_token=8 * 46080)
    reported = with_pull_credit({"holder": 640}, tiers, ["holder", "idle"],
                                {"holder": None, "idle": heavy}, config)
    assert assumed["idle"] > 0 and "idle" not in reported  # no credit, no answer
