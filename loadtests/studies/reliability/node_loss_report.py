"""The figures of a node-loss run (`node_loss.py`): how the requests ended relative to the
kill, when the router stopped sending to the lost replica, and what Serve's replica count
did meanwhile.

The router's own view comes from two places: its decision counter
(`iterserve:router_decisions_total`, sampled over HTTP: requests a replica accepted) and the
ingress's Serve log, which records what the counter cannot see: a request sent to the dead
replica that failed before it was accepted ("... will not be considered for future requests
because it has died"), a queue-length probe to it that timed out, and the controller's
broadcast that removed the replica. (The ingress's own "sent again" warnings come from the
iterserve logger, not Serve's, and are not in those files: they are not counted here.)
"""

from __future__ import annotations

import datetime
import glob
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from iterserve.loadtests.studies.reliability.chaos import Outcome

_LOG_LINE = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")
_REMOVED = re.compile(r"Got updated replicas for Deployment\(name='LLMReplica'.*-(\d+) removed")
_DIED = re.compile(r"Replica\(id='([^']+)'.*will not be considered for future requests "
                   r"because it has died")
_PROBE_FAILED = re.compile(r"Failed to get queue length from Replica\(id='([^']+)'")


class RequestSource(Protocol):
    outcomes: list[Outcome]

    def completed(self) -> int: ...

    def is_complete(self, outcome: Outcome) -> bool: ...

    def failures(self) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class IngressLogEvents:
    """What the ingress's Serve log says about the lost replica, in seconds since the load
    started."""

    removed_by_broadcast: list[float]  # the controller's update dropped a replica
    sent_to_dead: list[float]  # a request to it failed: Serve marked it dead, routed again
    probe_failed: list[float]  # a queue-length probe to it timed out

    def to_dict(self) -> dict[str, list[float]]:
        return {"removed_by_broadcast": self.removed_by_broadcast,
                "sent_to_dead": self.sent_to_dead,
                "probe_failed": self.probe_failed}


def _log_time(stamp: str) -> float:
    """A Serve log time stamp (local time, milliseconds) as time.time()."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read_ingress_log(session_dir: str, wall_start: float, dead_replica: str
                     ) -> IngressLogEvents:
    """Parse the ingress replicas' Serve logs under `session_dir` (times relative to
    `wall_start`, a time.time())."""
    removed: list[float] = []
    died: list[float] = []
    probes: list[float] = []
    pattern = os.path.join(session_dir, "logs", "serve", "replica_*_OpenAIIngress_*.log")
    for path in sorted(glob.glob(pattern)):
        with open(path, errors="replace") as log:
            for line in log:
                match = _LOG_LINE.match(line)
                if match is None:
                    continue
                at = round(_log_time(match.group(1)) - wall_start, 2)
                text = match.group(2)
                if (found := _REMOVED.search(text)) and int(found.group(1)) > 0:
                    removed.append(at)
                elif (found := _DIED.search(text)) and found.group(1) == dead_replica:
                    died.append(at)
                elif (found := _PROBE_FAILED.search(text)) and found.group(1) == dead_replica:
                    probes.append(at)
    return IngressLogEvents(removed, died, probes)


def requests_report(sources: Iterable[RequestSource], load_started: float, kill_at: float,
                    lost_at: float | None = None) -> dict[str, Any]:
    """How the requests ended, relative to the fault (every source together).

    `lost_at` is when the lost replica stopped serving (its worker's exit; default the
    kill): after the raylet is killed the replica's worker lives on for about a second and
    keeps accepting and streaming, so a stream started in that window and cut at the exit
    was under way on the lost node when it went. Whether a request was under way or not
    yet started is judged at `lost_at`; error times are measured from the kill."""
    sources = list(sources)
    lost_at = kill_at if lost_at is None else max(kill_at, lost_at)
    in_flight, after = 0, 0
    failed_in_flight: list[Outcome] = []
    failed_after: list[Outcome] = []
    error_times: list[float] = []
    for source in sources:
        for outcome in source.outcomes:
            started = outcome.started - load_started
            ended = outcome.ended - load_started
            if started < lost_at < ended:
                in_flight += 1
                if not source.is_complete(outcome):
                    failed_in_flight.append(outcome)
                    error_times.append(round(ended - kill_at, 2))
            elif started >= lost_at:
                after += 1
                if not source.is_complete(outcome):
                    failed_after.append(outcome)
    return {
        "requests": sum(len(s.outcomes) for s in sources),
        "complete": sum(s.completed() for s in sources),
        "in_flight_at_kill": in_flight,
        "in_flight_failed": len(failed_in_flight),
        # an SSE error event's payload (chaos.run_request keeps it as the error); a cut
        # connection or a client timeout reads "RemoteProtocolError: ..." / "client timeout"
        "in_flight_failed_with_sse_error": sum(1 for o in failed_in_flight
                                               if o.status == 200 and o.error
                                               and o.error.startswith("{")),
        "in_flight_failed_with_done": sum(1 for o in failed_in_flight if o.done),
        "in_flight_error_after_kill_s": sorted(error_times),
        "started_after_kill": after,
        "started_after_kill_failed": len(failed_after),
        "failures": [f for s in sources for f in s.failures()][:20],
    }


def _first_after(times: Iterable[float], after: float) -> float | None:
    return min((t for t in times if t >= after), default=None)


@dataclass(frozen=True)
class Decisions:
    """The router's accepted decisions for the lost replica (its decision counter)."""

    last_at: float | None  # when the counter last rose
    before_kill: int
    after_kill: int


def routing_report(decisions: Decisions, kill_at: float, dead_replica: str,
                   worker_exited_at: float | None, log: IngressLogEvents,
                   stats_period_s: float) -> dict[str, Any]:
    """The router's cut-over: the last request it sent the lost replica (accepted or not),
    when it learnt of the death, against one routing stats period."""
    accepted_last = decisions.last_at
    sends = [t for t in log.sent_to_dead if t >= kill_at]
    last_sent = max([t for t in (accepted_last, *sends) if t is not None], default=None)
    removed_at = _first_after(log.removed_by_broadcast, kill_at)
    learnt = min([t for t in (removed_at, _first_after(sends, kill_at)) if t is not None],
                 default=None)
    return {
        "dead_replica": dead_replica,
        "routing_stats_period_s": stats_period_s,
        "dead_replica_worker_exited_after_kill_s": (
            None if worker_exited_at is None else round(worker_exited_at - kill_at, 2)),
        "last_routed_to_dead_replica_s": accepted_last,
        "routed_to_dead_replica_before_kill": decisions.before_kill,
        "routed_to_dead_replica_after_kill": decisions.after_kill,
        "sent_to_dead_replica_after_kill_failed": len(sends),
        "router_learnt_of_death_after_kill_s": (
            None if learnt is None else round(learnt - kill_at, 2)),
        "router_removed_by_broadcast_after_kill_s": (
            None if removed_at is None else round(removed_at - kill_at, 2)),
        "last_sent_to_dead_replica_after_kill_s": (
            None if last_sent is None else round(last_sent - kill_at, 2)),
        "router_stopped_after_worker_exit_s": (
            None if last_sent is None or worker_exited_at is None
            else round(max(0.0, last_sent - worker_exited_at), 2)),
        "ingress_log": log.to_dict(),
    }


def replica_report(replica_counts: list[tuple[float, int]],
                   replica_states: list[tuple[float, dict[str, int]]], kill_at: float,
                   back_at: float) -> dict[str, Any]:
    """Serve's replica count (every state) before and after the fault."""
    before = [n for at, n in replica_counts if at < kill_at]
    after = [n for at, n in replica_counts if at >= kill_at]
    return {
        "replicas_before_fault": max(before, default=0),
        "max_replicas_after_fault": max(after, default=0),
        "max_replicas_seen": max(before + after, default=0),
        "replica_states_over_time": replica_states,
        "replica_back_after_node_return_s": round(back_at - kill_at, 2),
    }
