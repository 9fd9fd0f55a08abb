"""Node loss under streaming load: a two-node Ray cluster on this machine, one LLMReplica per
node, the worker node's raylet killed mid-load, then the node brought back.

    python -m iterserve.loadtests.node_loss [--clients 8] [--max-tokens 150] [--json out.json]

The head node holds Serve's controller, the HTTP proxy, the ingress and one replica; the
worker node (added once those are up, then `num_replicas` 2 with `max_replicas_per_node` 1)
holds the other replica. Under steady streaming load the worker is removed without grace
(`Cluster.remove_node(allow_graceful=False)`: its raylet and workers are killed). Measured:

* every request: how it ended and when, relative to the kill;
* the router's decisions per replica (`iterserve:router_decisions_total` on the ingress's
  GET /metrics), so the last request routed to the dead replica is known;
* the replica count Serve reports (all states), sampled throughout;
* when Serve runs two replicas again after the node returns.

The result is one JSON document (the timeline in seconds since the load started); the floors
are asserted by tests/reliability/test_node_loss.py. Everything is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import httpx

from iterserve.dashboards.metrics import ROUTER_DECISIONS, metric_name
from iterserve.loadtests.disruption import StreamingLoad, Timeline
from iterserve.loadtests.servers import free_port

APP_NAME = "iterserve"
SIM_COST = {"a_s": 0.02}  # a step is a 20 ms sleep: the Ray data path is not the bottleneck
SIM_ENGINE = {"runner": "simulated", "max_model_len": 1024, "num_gpu_blocks_override": 256,
              "max_num_seqs": 8}
HEAD_CPUS = 4
WORKER_CPUS = 2


def _replica_infos(url: str) -> list[dict[str, Any]]:
    try:
        return httpx.get(f"{url}/debug/replicas", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _replica_nodes() -> dict[str, str]:
    """Replica id -> node id of every live LLMReplica actor, and "ingress" -> the ingress's
    node (read from the GCS)."""
    import ray

    nodes = {}
    for info in ray._private.state.actors().values():  # no public GCS reader without dashboard
        name = info.get("Name") or ""
        if info.get("State") != "ALIVE":
            continue
        if "LLMReplica" in name:
            nodes[name.rsplit("#", 1)[-1]] = info["Address"]["NodeID"]
        elif "OpenAIIngress" in name:
            nodes["ingress"] = info["Address"]["NodeID"]
    return nodes


class Sampler:
    """Samples, every `period_s` in a thread: router decisions per replica and the replica
    count Serve reports (every state)."""

    def __init__(self, url: str, timeline: Timeline, period_s: float = 0.25) -> None:
        self.url = url
        self.timeline = timeline
        self.period_s = period_s
        self.decisions: list[tuple[float, dict[str, float]]] = []
        self.replica_counts: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families
        from ray import serve

        name = metric_name(ROUTER_DECISIONS)
        while not self._stop.is_set():
            now = time.monotonic() - self.timeline.start
            try:
                text = httpx.get(f"{self.url}/metrics", timeout=5).text
                counts = {s.labels["replica"]: s.value
                          for f in text_string_to_metric_families(text) for s in f.samples
                          if s.name == name}
                self.decisions.append((now, counts))
            except httpx.HTTPError:
                pass  # the sample is missing; the next one covers it
            status = serve.status().applications.get(APP_NAME)
            if status is not None and "LLMReplica" in status.deployments:
                states = status.deployments["LLMReplica"].replica_states
                self.replica_counts.append((now, sum(states.values())))
            time.sleep(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def last_decision_to(self, replica: str) -> float | None:
        """When the router last sent a request to `replica` (the counter's last increase)."""
        last, previous = None, None
        for at, counts in self.decisions:
            value = counts.get(replica)
            if value is not None and previous is not None and value > previous:
                last = at
            previous = value if value is not None else previous
        return last


def run_node_loss(clients: int = 8, max_tokens: int = 150, load_before_s: float = 6.0,
                  down_s: float = 20.0, after_s: float = 8.0) -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["ITERSERVE_SIM_COST_MODEL"] = json.dumps(SIM_COST)  # every worker inherits it
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from iterserve.deploy.app import build_app

    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": HEAD_CPUS, "include_dashboard": False,
        "object_store_memory": 128 * 1024**2})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app_args: dict[str, Any] = {"engine_kwargs": SIM_ENGINE, "num_replicas": 2, "router": "kv",
                                "max_replicas_per_node": 1}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        # Deployed while the head is the only node, so that the ingress lands there (it asks
        # for no CPU and Serve spreads it anywhere); the second replica waits for the worker.
        deploying = threading.Thread(target=serve.run, args=(build_app(app_args),),
                                     kwargs={"name": APP_NAME, "route_prefix": "/"}, daemon=True)
        deploying.start()
        head_node = ray.get_runtime_context().get_node_id()
        _wait_for(lambda: len(_replica_infos(url)) == 1, 120, "the ingress and one replica")
        worker = cluster.add_node(num_cpus=WORKER_CPUS, object_store_memory=128 * 1024**2)
        cluster.wait_for_nodes()
        deploying.join(timeout=120)
        _wait_for(lambda: len(_replica_infos(url)) == 2, 120, "two replicas")
        placement = _replica_nodes()
        on_worker = [r for r, node in placement.items() if node != head_node]
        if len(on_worker) != 1 or placement.get("ingress") != head_node:
            raise RuntimeError(f"expected one replica on the worker, the ingress on the head: "
                               f"{placement} (head {head_node})")
        dead_replica = on_worker[0]
        timeline = Timeline()
        with StreamingLoad(url, clients, max_tokens, timeout_s=120) as load, \
                Sampler(url, timeline) as sampler:
            timeline.start = load_started = time.monotonic()
            sampler.timeline = timeline
            timeline.mark(f"load started ({clients} streaming clients, {max_tokens} tokens)")
            time.sleep(load_before_s)
            replicas_before = max((n for _, n in sampler.replica_counts), default=2)
            kill_at = timeline.mark("worker node's raylet killed")
            cluster.remove_node(worker, allow_graceful=False)
            _wait_for(lambda: len(_replica_infos(url)) == 1, 120, "the dead replica to go")
            timeline.mark("/debug/replicas lists one replica")
            time.sleep(down_s)
            timeline.mark("worker node added back")
            cluster.add_node(num_cpus=WORKER_CPUS, object_store_memory=128 * 1024**2)
            _wait_for(lambda: len(_replica_infos(url)) == 2, 180, "the replica to come back")
            back_at = timeline.mark("two replicas answer again")
            time.sleep(after_s)
            timeline.mark("load stopping")
        timeline.mark("load stopped")
        return _report(load, sampler, timeline, load_started, kill_at, back_at, dead_replica,
                       replicas_before)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _report(load: StreamingLoad, sampler: Sampler, timeline: Timeline, load_started: float,
            kill_at: float, back_at: float, dead_replica: str,
            replicas_before: int) -> dict[str, Any]:
    in_flight, after, failed_in_flight, failed_after, error_times = 0, 0, [], [], []
    for outcome in load.outcomes:
        started = outcome.started - load_started
        ended = outcome.ended - load_started
        if started < kill_at < ended:
            in_flight += 1
            if not load.is_complete(outcome):
                failed_in_flight.append(outcome)
                error_times.append(round(ended - kill_at, 2))
        elif started >= kill_at:
            after += 1
            if not load.is_complete(outcome):
                failed_after.append(outcome)
    last_to_dead = sampler.last_decision_to(dead_replica)
    return {
        "timeline": timeline.events,
        "requests": len(load.outcomes),
        "complete": load.completed(),
        "in_flight_at_kill": in_flight,
        "in_flight_failed": len(failed_in_flight),
        # an SSE error event's payload (chaos.run_request keeps it as the error); a cut
        # connection or a client timeout reads "RemoteProtocolError: ..." / "client timeout"
        "in_flight_failed_with_sse_error": sum(1 for o in failed_in_flight
                                               if o.status == 200 and o.error
                                               and o.error.startswith("{")),
        "in_flight_error_after_kill_s": sorted(error_times),
        "started_after_kill": after,
        "started_after_kill_failed": len(failed_after),
        "failures": load.failures()[:20],
        "dead_replica": dead_replica,
        "last_routed_to_dead_replica_s": last_to_dead,
        "router_decisions_around_kill": [
            (at, counts) for at, counts in sampler.decisions if kill_at - 1 <= at <= kill_at + 3],
        "router_stopped_after_kill_s": (None if last_to_dead is None
                                        else round(max(0.0, last_to_dead - kill_at), 2)),
        "replicas_before_fault": replicas_before,
        "max_replicas_seen": max((n for _, n in sampler.replica_counts), default=0),
        "replica_back_after_node_return_s": round(back_at - kill_at, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--down-s", type=float, default=20.0)
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args(argv)
    result = run_node_loss(args.clients, args.max_tokens, down_s=args.down_s)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
