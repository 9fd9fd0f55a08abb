"""`AdaptersInFlight` (autoscale/lora_in_flight.py): the adapters of a router's requests in
flight per replica, and the replica's load with them held and running."""

from __future__ import annotations

import time

from iterserve.autoscale.lora_in_flight import AdaptersInFlight, with_adapters_in_flight
from iterserve.autoscale.signals import ReplicaLoad


def test_an_adapter_counts_while_any_of_its_requests_is_in_flight() -> None:
    flights: AdaptersInFlight[str] = AdaptersInFlight()
    flights.routed("q1", "r1", "sql")
    flights.routed("q2", "r1", "sql")
    flights.routed("q3", "r1", None)  # the base model: nothing to hold
    flights.routed("q4", "r2", "chat")
    assert flights.adapters("r1") == {"sql"} and flights.adapters("r2") == {"chat"}
    flights.completed("q1")
    assert flights.adapters("r1") == {"sql"}
    flights.completed("q2")
    flights.completed("q3")
    flights.completed("never-routed")  # a rejected request: ignored
    assert flights.adapters("r1") == frozenset()
    flights.keep_only(["r1"])
    assert flights.adapters("r2") == frozenset()
    flights.completed("q4")  # already forgotten with its replica


def test_a_request_routed_again_counts_on_its_new_replica_only() -> None:
    flights: AdaptersInFlight[str] = AdaptersInFlight()
    flights.routed("q1", "r1", "sql")
    flights.routed("q1", "r2", "sql")
    assert flights.adapters("r1") == frozenset() and flights.adapters("r2") == {"sql"}


def test_the_load_gains_the_adapters_in_flight_as_held_and_running() -> None:
    load = ReplicaLoad(kv_usage=0.1, num_waiting=0, num_running=1, num_free_blocks=900,
                       num_total_blocks=1000, step_token_rate=0.0, timestamp=time.time(),
                       lora_running=frozenset({"a"}), max_loras=2).with_adapters(["a", "b"])
    seen = with_adapters_in_flight(load, frozenset({"sql"}))
    assert seen is not None
    assert seen.lora_adapters == {"a", "b", "sql"} and seen.lora_running == {"a", "sql"}
    assert not seen.has_slot_for("chat")  # sql's request takes the second slot
    assert with_adapters_in_flight(load, frozenset()) is load
    assert with_adapters_in_flight(None, frozenset()) is None
    no_stats = with_adapters_in_flight(None, frozenset({"sql"}))  # holds what is in flight
    assert no_stats is not None and no_stats.lora_adapters == no_stats.lora_running == {"sql"}
