"""LoRA-aware routing: replicas report the adapters they hold, the router prefers a holder
under a load guard (a hot adapter spreads), and an adapter's prefix is looked up in its own
cache namespace. Pure functions first, then the real KVAwareRouter with fake replicas (the
harness of test_router_cache_reports)."""

from __future__ import annotations

import asyncio
import time

from block_hash_oracle import prompt_block_hashes
from test_router_cache_reports import BLOCK, _FakeReplica, _router

from iterserve.autoscale.lora_affinity import prefer_adapter_holders, request_adapter
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.replica.block_keys import cache_namespace
from iterserve.replica.lora_adapter import LoRARequest

PROMPT = list(range(2000, 2000 + 8 * BLOCK + 3))


def load(waiting: int = 0, adapters: tuple[str, ...] = (), draining: bool = False,
         hashes: list[int] | None = None, running: tuple[str, ...] = (),
         max_loras: int = 0) -> ReplicaLoad:
    plain = ReplicaLoad(kv_usage=0.1, num_waiting=waiting, num_running=1, num_free_blocks=900,
                        num_total_blocks=1000, step_token_rate=0.0, timestamp=time.time(),
                        draining=draining, lora_running=frozenset(running),
                        max_loras=max_loras)
    return plain.with_adapters(adapters).with_cached_blocks(hashes, BLOCK)


def prefer(ranked: list[str], loads: dict[str, ReplicaLoad], adapter: str | None,
           slack: float, share: float = 0.0) -> list[str]:
    waiting = {rid: load.num_waiting for rid, load in loads.items()}
    return prefer_adapter_holders(ranked, loads, waiting, adapter, slack, share)


def test_the_adapters_held_and_running_travel_in_the_routing_stats() -> None:
    sent = load(adapters=("b", "a"), running=("a",), max_loras=4).to_dict()
    assert sent["lora_adapters"] == ["a", "b"]
    got = ReplicaLoad.from_dict(sent)
    assert got.lora_adapters == {"a", "b"} and got.lora_running == {"a"} and got.max_loras == 4
    assert "lora_adapters" not in load().to_dict()  # nothing held: nothing sent
    assert "lora_running" not in load().to_dict()


def test_the_request_names_its_adapter_positionally_or_by_keyword() -> None:
    lora = LoRARequest("sql", "/adapters/sql")
    assert request_adapter([[1, 2], None, "r", 0, lora], {}) == "sql"
    assert request_adapter([[1, 2]], {"lora_request": lora}) == "sql"
    assert request_adapter([[1, 2], None, "r", 0, None], {}) is None


def test_the_least_waiting_holder_within_the_slack_goes_first() -> None:
    loads = {"x": load(0), "y": load(1, ("sql",)), "z": load(0, ("sql",))}
    assert prefer(["x", "y", "z"], loads, "sql", 1.0) == ["z", "x", "y"]
    assert prefer(["x", "y", "z"], loads, None, 1.0) == ["x", "y", "z"]


def test_a_replica_running_the_adapter_goes_before_one_merely_holding_it() -> None:
    loads = {"x": load(0, ("sql",), max_loras=2),
             "y": load(1, ("sql",), running=("sql",), max_loras=2)}
    assert prefer(["x", "y"], loads, "sql", 1.0)[0] == "y"


def test_a_holder_whose_slots_all_run_other_adapters_is_passed_over() -> None:
    """Its request would wait for a slot while those adapters keep getting requests."""
    full = load(0, ("sql",), running=("a", "b"), max_loras=2)
    loads = {"full": full, "free": load(1, running=("a",), max_loras=2)}
    assert full.has_slot_for("a") and not full.has_slot_for("sql")
    assert prefer(["full", "free"], loads, "sql", 1.0)[0] == "free"


def test_a_busy_holder_loses_to_load_so_a_hot_adapter_spreads() -> None:
    loads = {"x": load(0), "y": load(3, ("sql",))}
    assert prefer(["x", "y"], loads, "sql", 1.0) == ["x", "y"]
    assert prefer(["x", "y"], loads, "sql", 4.0) == ["y", "x"]


def test_the_slack_is_measured_from_the_least_waiting_replica_not_the_leader() -> None:
    """A leader the score put first with a long queue (the routed-work balance keeps a slow
    replica first) must not let every holder within its queue take the request."""
    loads = {"leader": load(30), "holder": load(29, ("sql",)), "idle": load(0)}
    assert prefer(["leader", "holder", "idle"], loads, "sql", 1.0)[0] == "idle"
    loads["leader"] = load(30, ("sql",))  # even a leader holding the adapter
    assert prefer(["leader", "holder", "idle"], loads, "sql", 1.0)[0] == "idle"


def test_a_draining_holder_is_passed_over() -> None:
    loads = {"x": load(0), "y": load(0, ("sql",), draining=True), "z": load(0, ("sql",))}
    assert prefer(["x", "y", "z"], loads, "sql", 1.0)[0] == "z"


def _pending(args: list, rid: str):  # noqa: ANN202 - a PendingRequest
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    meta = RequestMetadata(request_id=rid, internal_request_id=rid)
    return PendingRequest(args=args, kwargs={}, metadata=meta, future=None)


def _first(router, replicas: list[_FakeReplica], args: list, n: int = 20) -> set[str]:  # noqa: ANN001
    return {asyncio.run(router.choose_replicas(replicas, _pending(args, f"q{i}")))[0][0]
            .replica_id.unique_id for i in range(n)}


def test_the_router_sends_an_adapter_request_to_its_holder() -> None:
    router = _router()
    replicas = [_FakeReplica("holder", load(0, ("sql",)).to_dict()),
                _FakeReplica("other", load(0).to_dict())]
    lora = LoRARequest("sql", "/adapters/sql")
    assert _first(router, replicas, [PROMPT, None, "r", 0, lora]) == {"holder"}
    assert _first(router, replicas, [PROMPT]) == {"holder", "other"}  # base: the shuffle


def test_an_adapter_prefix_is_matched_only_in_its_namespace() -> None:
    router = _router()
    base_blocks = prompt_block_hashes(PROMPT, BLOCK)
    replicas = [_FakeReplica("base_cache", load(hashes=base_blocks).to_dict()),
                _FakeReplica("other", load().to_dict())]
    lora = LoRARequest("sql", "/adapters/sql")
    # the base prompt's blocks draw a base request, never the adapter's
    assert _first(router, replicas, [PROMPT]) == {"base_cache"}
    assert _first(router, replicas, [PROMPT, None, "r", 0, lora]) == {"base_cache", "other"}
    assert cache_namespace(adapter="sql") != b""


def test_a_tenant_namespace_narrows_to_the_adapter_alike_in_engine_and_router() -> None:
    from iterserve.autoscale.router import request_namespace
    from iterserve.replica.block_keys import with_adapter

    tenant = cache_namespace(salt="acme")
    both = cache_namespace(salt="acme", adapter="sql")
    assert with_adapter(tenant, "sql") == both and with_adapter(b"", "sql") == cache_namespace(
        adapter="sql")
    assert with_adapter(tenant, None) == tenant
    lora = LoRARequest("sql", "/adapters/sql")
    pending = _pending([PROMPT, None, "r", 0], "n1")
    pending.kwargs.update(cache_namespace=tenant, lora_request=lora)
    assert request_namespace(pending) == both  # what the engine's add_request computes


def test_an_adapter_no_replica_holds_goes_where_fewest_adapters_are_held() -> None:
    """As Ray's multiplexing places a new model: the replica holding the fewest adapters
    takes it (a new partition, not one more adapter mixed into the leader's slots), among
    those within the slack and with a slot free; the ranking breaks ties."""
    loads = {"leader": load(0, ("a", "b", "c")), "light": load(2, ("d",)),
             "empty_far": load(20), "also_light": load(1, ("e",))}
    ranked = ["leader", "also_light", "light", "empty_far"]
    assert prefer(ranked, loads, "sql", 8.0)[0] == "also_light"
    full = load(0, (), running=("x", "y"), max_loras=2)  # holds none, but no slot free
    assert prefer(["leader", "full"], {"leader": loads["leader"], "full": full}, "sql",
                  8.0)[0] == "leader"


def test_the_router_counts_its_requests_in_flight_as_holding_their_adapter() -> None:
    """The replicas' stats show an adapter only after a request for it ran there and the
    next report came: until then, the replica this router sent the adapter's first request
    to takes the next ones, not a second replica that would read it from disk again."""
    router = _router()
    replicas = [_FakeReplica(name, load(0).to_dict()) for name in ("r1", "r2", "r3", "r4")]
    lora = LoRARequest("sql", "/adapters/sql")
    args = [PROMPT, None, "r", 0, lora]
    first = asyncio.run(router.choose_replicas(replicas, _pending(args, "p0")))[0][0]
    router.on_request_routed(_pending(args, "p0"), first.replica_id, None)
    assert _first(router, replicas, args) == {first.replica_id.unique_id}
    # another adapter avoids it: the first's request holds one of its adapters
    other = [PROMPT, None, "r", 0, LoRARequest("chat", "/adapters/chat")]
    assert first.replica_id.unique_id not in _first(router, replicas, other)
    router.on_request_completed(first.replica_id, "p0")
    assert len(_first(router, replicas, args, n=40)) > 1  # nothing in flight: the shuffle


def test_a_hot_adapter_spreads_to_a_new_replica_before_its_holder_queues() -> None:
    """Half the requests over 4 replicas: 2 replicas' worth on one holder. Its next request
    goes to the replica holding the fewest adapters that does not hold it, though the holder
    is idle and within the slack; a cold adapter (a tenth of a replica's share) stays."""
    loads = {"holder": load(0, ("hot",)), "busy": load(1, ("a", "b")), "light": load(1, ("c",))}
    ranked = ["holder", "busy", "light"]
    assert prefer(ranked, loads, "hot", 8.0, share=0.5)[0] == "light"
    assert prefer(ranked, loads, "hot", 8.0, share=0.1 / 3)[0] == "holder"
    loads["light"] = load(1, ("c", "hot"))  # two holders for 1.5 replicas' worth: enough
    assert prefer(ranked, loads, "hot", 8.0, share=0.5)[0] == "holder"


def test_a_hot_adapters_spread_stays_within_the_slack_and_the_slots() -> None:
    loads = {"holder": load(0, ("hot",)), "far": load(20),
             "full": load(0, running=("x", "y"), max_loras=2)}
    assert prefer(["far", "full", "holder"], loads, "hot", 8.0, share=0.9)[0] == "holder"


def test_a_replica_without_stats_holds_the_adapters_of_requests_in_flight_there() -> None:
    """Until a replica's first report, the router's own request for an adapter there makes
    it the adapter's holder: the next request for it must not read it on another replica."""
    from iterserve.autoscale.lora_in_flight import with_adapters_in_flight

    held = {"sent": with_adapters_in_flight(None, frozenset({"sql"})),
            "other": with_adapters_in_flight(None, frozenset())}
    assert held["other"] is None and held["sent"] is not None
    assert held["sent"].has_slot_for("chat")  # its slots are not reported: room for any
    assert prefer_adapter_holders(["other", "sent"], held, {}, "sql", 8.0, 0.0)[0] == "sent"


def test_the_router_spreads_an_adapter_as_its_share_of_its_requests_grows() -> None:
    """The real KVAwareRouter: 8 requests for one adapter in a row (all in flight, no
    replica reporting it) go to 3 of the 4 replicas (8/12 of the requests counted with one
    per replica: 2.7 replicas' worth); requests for a cold one among base-model traffic
    stay on one replica. Without the share rule, all 8 stay on the first (within the slack)."""
    router = _router()
    replicas = [_FakeReplica(name, load(0).to_dict()) for name in ("r1", "r2", "r3", "r4")]

    def route(args: list, rid: str) -> str:
        chosen = asyncio.run(router.choose_replicas(replicas, _pending(args, rid)))[0][0]
        router.on_request_routed(_pending(args, rid), chosen.replica_id, None)
        return chosen.replica_id.unique_id

    hot = [PROMPT, None, "r", 0, LoRARequest("hot", "/adapters/hot")]
    assert len({route(hot, f"h{i}") for i in range(8)}) == 3
    for i in range(8):
        router.on_request_completed(next(r.replica_id for r in replicas), f"h{i}")
    for i in range(40):
        route([PROMPT], f"b{i}")
    cold = [PROMPT, None, "r", 0, LoRARequest("cold", "/adapters/cold")]
    assert len({route(cold, f"c{i}") for i in range(5)}) == 1
