"""The node-loss report's classification: under way or not yet started, judged when the lost
replica stopped serving (its worker's exit), not at the raylet kill. Pure Python, no Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.loadtests.studies.reliability.chaos import Outcome
from iterserve.loadtests.studies.reliability.node_loss_report import requests_report


@dataclass
class Source:
    outcomes: list[Outcome] = field(default_factory=list)

    def completed(self) -> int:
        return sum(1 for o in self.outcomes if o.ok)

    def is_complete(self, outcome: Outcome) -> bool:
        return outcome.ok

    def failures(self) -> list[dict[str, Any]]:
        return [{"error": o.error} for o in self.outcomes if not o.ok]


def cut(started: float, ended: float) -> Outcome:
    return Outcome(status=200, error="{'message': 'cut'}", num_chunks=9, started=started,
                   ended=ended, done=True)


def served(started: float, ended: float) -> Outcome:
    return Outcome(status=200, started=started, ended=ended, done=True)


def test_a_stream_started_between_the_kill_and_the_exit_was_under_way() -> None:
    # kill at 10 s, the lost replica's worker exits at 11 s; times since load start (0 s)
    source = Source([served(8.0, 9.0), cut(9.5, 12.5), cut(10.4, 12.5), served(11.5, 13.0)])
    report = requests_report([source], 0.0, kill_at=10.0, lost_at=11.0)
    assert report["in_flight_at_kill"] == 2
    assert report["in_flight_failed"] == 2
    assert report["in_flight_failed_with_sse_error"] == 2
    assert report["in_flight_error_after_kill_s"] == [2.5, 2.5]  # measured from the kill
    assert report["started_after_kill"] == 1 and report["started_after_kill_failed"] == 0


def test_without_an_exit_time_the_kill_decides() -> None:
    source = Source([cut(9.5, 12.5), cut(10.4, 12.5)])
    report = requests_report([source], 0.0, kill_at=10.0)
    assert report["in_flight_failed"] == 1
    assert report["started_after_kill_failed"] == 1


def test_an_exit_time_before_the_kill_is_not_used() -> None:
    source = Source([cut(9.5, 12.5)])
    report = requests_report([source], 0.0, kill_at=10.0, lost_at=9.0)
    assert report["in_flight_failed"] == 1
