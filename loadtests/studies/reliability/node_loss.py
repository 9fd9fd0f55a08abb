"""Node loss under streaming load: a two-node Ray cluster on this machine, one LLMReplica per
node, the worker node's raylet killed mid-load, then the node brought back.

    python -m iterserve.loadtests.studies.reliability.node_loss [--clients 8] [--max-tokens 150] \
        [--probe-clients 8]
        [--down-s 20] [--autoscale] [--temp-dir /tmp/ray_nl] [--json out.json]

The head node holds Serve's controller, the HTTP proxy, the ingress and one replica; the
worker node (added once those are up, then `num_replicas` 2 with `max_replicas_per_node` 1)
holds the other replica. The engine is the simulated runner with a 20 ms step (the
`simulator` engine setting). The load runs until the router has sent each replica a few
requests (the ingress's first requests wait for its tokenizer), then `load_before_s` more,
and until the worker's replica runs `KILL_WHEN_RUNNING` requests (read from
`/debug/replicas`: time alone left it idle at the kill on a loaded box); then the worker is
removed without grace (`Cluster.remove_node(allow_graceful=False)`: its
raylet and workers are killed). Measured:

* every request: how it ended and when, relative to the kill (streams cut by the fault: an
  SSE error event? a `data: [DONE]`?);
* each replica's own count of `generate` calls just before the kill (`/debug/replicas`), so
  a run in which the lost replica carried nothing cannot pass for a node loss;
* the router's decisions per replica (`iterserve:router_decisions_total` on the ingress's
  GET /metrics: requests a replica accepted), and from the ingress's Serve log the requests
  sent to the dead replica that failed and were routed again, the streams the ingress sent
  again, and when the controller's broadcast removed the replica (node_loss_report.py);
* the replica count Serve reports (all states), sampled throughout;
* when the lost replica's worker process exits (it outlives its raylet by a moment);
* when Serve runs two replicas again after the node returns.

`--probe-clients` adds closed-loop clients of short streams (`--probe-tokens`) so that the
router decides often and its cut-over after the fault is measured, not guessed. `--autoscale`
deploys `num_replicas="auto"` (min 2, max 4: the KV autoscaler) instead of a fixed 2, so the
replica count over time shows what the autoscaler does meanwhile. After the kill nothing
polls `/debug/replicas` (a broadcast: it would tell the router about the dead replica
itself); the controller's view (`serve.status`) is read instead.

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

from iterserve.autoscale.autoscaling_policy import autoscaling_env_vars
from iterserve.autoscale.config import AutoscaleConfig, RouterConfig
from iterserve.dashboards.metrics import ROUTER_DECISIONS, metric_name
from iterserve.loadtests.servers import free_port
from iterserve.loadtests.studies.reliability.disruption import StreamingLoad, Timeline
from iterserve.loadtests.studies.reliability.node_loss_report import (
    Decisions,
    read_ingress_log,
    replica_report,
    requests_report,
    routing_report,
)

APP_NAME = "iterserve"
SIM_COST = {"a_s": 0.02}  # a step is a 20 ms sleep: the Ray data path is not the bottleneck
SIM_ENGINE = {"runner": "simulated", "simulator": json.dumps(SIM_COST), "max_model_len": 1024,
              "num_gpu_blocks_override": 256, "max_num_seqs": 8}
HEAD_CPUS = 4
WORKER_CPUS = 2
AUTOSCALE = AutoscaleConfig(min_replicas=2, max_replicas=4)
SAMPLE_PERIOD_S = 0.1
WARM_DECISIONS = 3  # requests routed to each replica before the timed phase starts
WARM_TIMEOUT_S = 120.0
# Streams running on the replica to be lost when the raylet is killed. Probes take ~0.3 s
# and the dying worker serves on for ~1 s, so one running request may be a probe that
# completes; at two, a long stream is almost always among them.
KILL_WHEN_RUNNING = 2
KILL_WAIT_S = 60.0


def _replica_infos(url: str) -> list[dict[str, Any]]:
    try:
        return httpx.get(f"{url}/debug/replicas", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _wait_for_running(url: str, replica: str, at_least: int, timeout_s: float
                      ) -> list[dict[str, Any]]:
    """Poll /debug/replicas until `replica`'s engine runs `at_least` requests; the snapshot
    that showed it."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = _replica_infos(url)
        running = {i.get("replica_id"): int(i.get("stats", {}).get("num_running", 0))
                   for i in infos}
        if running.get(replica, 0) >= at_least:
            return infos
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {at_least} requests running on the "
                               f"replica to be lost (last: {running})")
        time.sleep(0.05)


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _replica_actors() -> dict[str, tuple[str, int]]:
    """Replica id -> (node id, worker pid) of every live LLMReplica actor, and "ingress" ->
    the ingress's (read from the GCS)."""
    import ray

    actors = {}
    for info in ray._private.state.actors().values():  # no public GCS reader without dashboard
        name = info.get("Name") or ""
        if info.get("State") != "ALIVE":
            continue
        where = (info["Address"]["NodeID"], int(info.get("Pid") or 0))
        if "LLMReplica" in name:
            actors[name.rsplit("#", 1)[-1]] = where
        elif "OpenAIIngress" in name:
            actors["ingress"] = where
    return actors


def _process_alive(pid: int) -> bool:
    """A process that exited is gone from /proc or a zombie (its raylet parent was killed)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _serve_replica_states() -> dict[str, int]:
    """LLMReplica's replica count per state, as the controller reports it."""
    from ray import serve

    status = serve.status().applications.get(APP_NAME)
    if status is None or "LLMReplica" not in status.deployments:
        return {}
    states = status.deployments["LLMReplica"].replica_states
    return {getattr(k, "value", str(k)): int(v) for k, v in states.items()}


class Sampler:
    """Samples, every `period_s` in a thread: router decisions per replica, the replica count
    Serve reports (every state), and whether the watched worker process still runs."""

    def __init__(self, url: str, timeline: Timeline, watch_pid: int = 0,
                 period_s: float = SAMPLE_PERIOD_S) -> None:
        self.url = url
        self.timeline = timeline
        self.period_s = period_s
        self.watch_pid = watch_pid
        self.decisions: list[tuple[float, dict[str, float]]] = []
        self.replica_counts: list[tuple[float, int]] = []
        self.replica_states: list[tuple[float, dict[str, int]]] = []
        self.watched_exit_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample_decisions(self, now: float) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        name = metric_name(ROUTER_DECISIONS)
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return  # the sample is missing; the next one covers it
        counts = {s.labels["replica"]: s.value
                  for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == name}
        self.decisions.append((now, counts))

    def _sample_replicas(self, now: float) -> None:
        states = _serve_replica_states()
        if states:
            self.replica_counts.append((now, sum(states.values())))
            if not self.replica_states or self.replica_states[-1][1] != states:
                self.replica_states.append((round(now, 2), states))

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic() - self.timeline.start
            if self.watch_pid and self.watched_exit_at is None \
                    and not _process_alive(self.watch_pid):
                self.watched_exit_at = round(now, 2)
            self._sample_decisions(now)
            self._sample_replicas(now)
            time.sleep(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def last_decision_to(self, replica: str) -> float | None:
        """When the router last sent a request to `replica` (the counter's last increase;
        a replica missing from the counter has had none)."""
        last, previous = None, 0.0
        for at, counts in self.decisions:
            value = counts.get(replica, previous)
            if value > previous:
                last = at
            previous = value
        return last

    def decisions_at(self, replica: str, at: float | None = None) -> int:
        """The router's decisions for `replica` up to time `at` (None: the last sample)."""
        samples = [c.get(replica, 0.0) for t, c in self.decisions if at is None or t <= at]
        return int(samples[-1]) if samples else 0

    def decisions_for(self, replica: str, kill_at: float) -> Decisions:
        before = self.decisions_at(replica, kill_at)
        return Decisions(self.last_decision_to(replica), before,
                         self.decisions_at(replica) - before)

    def all_served(self, replicas: list[str], at_least: int) -> bool:
        """Every replica in `replicas` has been sent at least `at_least` requests."""
        return bool(self.decisions) and all(
            self.decisions[-1][1].get(r, 0.0) >= at_least for r in replicas)


def _running_replicas() -> int:
    return _serve_replica_states().get("RUNNING", 0)


def run_node_loss(clients: int = 8, max_tokens: int = 150, load_before_s: float = 6.0,
                  down_s: float = 20.0, after_s: float = 8.0, probe_clients: int = 0,
                  probe_tokens: int = 16, autoscale: bool = False,
                  temp_dir: str | None = None) -> dict[str, Any]:
    """temp_dir: the cluster's Ray temp folder (its logs; None: Ray's default, /tmp/ray)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if autoscale:  # Serve reads these at import, in the controller and the replicas
        os.environ.update(autoscaling_env_vars(AUTOSCALE))
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from iterserve.deploy.app import build_app

    node_args: dict[str, Any] = {"object_store_memory": 128 * 1024**2}
    if temp_dir is not None:
        node_args["temp_dir"] = temp_dir
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": HEAD_CPUS, "include_dashboard": False, **node_args})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app_args: dict[str, Any] = {"engine_kwargs": SIM_ENGINE, "num_replicas": 2, "router": "kv",
                                "max_replicas_per_node": 1}
    if autoscale:
        app_args.update(num_replicas="auto", min_replicas=AUTOSCALE.min_replicas,
                        max_replicas=AUTOSCALE.max_replicas)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        # Deployed while the head is the only node, so that the ingress lands there (it asks
        # for no CPU and Serve spreads it anywhere); the second replica waits for the worker.
        deploying = threading.Thread(target=serve.run, args=(build_app(app_args),),
                                     kwargs={"name": APP_NAME, "route_prefix": "/"}, daemon=True)
        deploying.start()
        head_node = ray.get_runtime_context().get_node_id()
        _wait_for(lambda: len(_replica_infos(url)) == 1, 120, "the ingress and one replica")
        worker = cluster.add_node(num_cpus=WORKER_CPUS, **node_args)
        cluster.wait_for_nodes()
        deploying.join(timeout=120)
        _wait_for(lambda: len(_replica_infos(url)) == 2, 120, "two replicas")
        placement = _replica_actors()
        on_worker = [r for r, (node, _) in placement.items() if node != head_node]
        if len(on_worker) != 1 or placement.get("ingress", ("",))[0] != head_node:
            raise RuntimeError(f"expected one replica on the worker, the ingress on the head: "
                               f"{placement} (head {head_node})")
        dead_replica = on_worker[0]
        replicas = [r for r in placement if r != "ingress"]
        session_dir = ray._private.worker._global_node.get_session_dir_path()
        timeline = Timeline()
        with StreamingLoad(url, clients, max_tokens, timeout_s=120) as load, \
                StreamingLoad(url, probe_clients, probe_tokens, timeout_s=120) as probes, \
                Sampler(url, timeline, watch_pid=placement[dead_replica][1]) as sampler:
            timeline.start = load_started = time.monotonic()
            wall_start = time.time()
            sampler.timeline = timeline
            timeline.mark(f"load started ({clients} streaming clients, {max_tokens} tokens; "
                          f"{probe_clients} probe clients, {probe_tokens} tokens)")
            # Steady load first: the kill must find requests on the replica it takes away
            # (the ingress's first requests wait for its tokenizer; the router needs a few
            # stats periods to spread them).
            _wait_for(lambda: sampler.all_served(replicas, WARM_DECISIONS), WARM_TIMEOUT_S,
                      f"{WARM_DECISIONS} requests routed to each replica")
            timeline.mark(f"each replica has been routed {WARM_DECISIONS} requests")
            time.sleep(load_before_s)
            # Timing alone is not enough: on a loaded box the router sometimes had nothing
            # running on the worker's replica at the kill, and the run proved nothing.
            infos = _wait_for_running(url, dead_replica, KILL_WHEN_RUNNING, KILL_WAIT_S)
            served_before = {i["replica_id"]: i["num_requests"] for i in infos}
            running_before = {i["replica_id"]: int(i["stats"]["num_running"]) for i in infos}
            kill_at = timeline.mark("worker node's raylet killed")
            cluster.remove_node(worker, allow_graceful=False)
            _wait_for(lambda: _running_replicas() == 1, 120, "the dead replica to go")
            timeline.mark("the controller runs one replica")
            time.sleep(down_s)
            timeline.mark("worker node added back")
            cluster.add_node(num_cpus=WORKER_CPUS, **node_args)
            _wait_for(lambda: len(_replica_infos(url)) == 2, 180, "the replica to come back")
            back_at = timeline.mark("two replicas answer again")
            time.sleep(after_s)
            timeline.mark("load stopping")
        timeline.mark("load stopped")
        if sampler.watched_exit_at is not None:
            timeline.events.append((sampler.watched_exit_at, "the lost replica's worker exited"))
            timeline.events.sort()
        log = read_ingress_log(session_dir, wall_start, dead_replica)
        return {
            "autoscale": autoscale, "timeline": timeline.events,
            "generate_calls_before_kill": served_before,
            "running_before_kill": running_before,
            **requests_report((load, probes), load_started, kill_at, sampler.watched_exit_at),
            **routing_report(sampler.decisions_for(dead_replica, kill_at), kill_at,
                             dead_replica, sampler.watched_exit_at, log,
                             RouterConfig().routing_stats_period_s),
            "sample_period_s": sampler.period_s,
            "router_decisions_around_kill": [
                (round(at, 2), counts) for at, counts in sampler.decisions
                if kill_at - 1 <= at <= kill_at + 5],
            **replica_report(sampler.replica_counts, sampler.replica_states, kill_at, back_at),
        }
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8,
                        help="closed-loop streaming clients during the run")
    parser.add_argument("--max-tokens", type=int, default=150, help="tokens each stream asks for")
    parser.add_argument("--down-s", type=float, default=20.0, help="seconds the worker node stays down")
    parser.add_argument("--probe-clients", type=int, default=0,
                        help="extra clients of short streams: frequent routing decisions")
    parser.add_argument("--probe-tokens", type=int, default=16,
                        help="tokens of each --probe-clients stream")
    parser.add_argument("--autoscale", action="store_true",
                        help='num_replicas="auto" (min 2, max 4) instead of 2')
    parser.add_argument("--temp-dir", default=None,
                        help="Ray's temp folder for this cluster (default /tmp/ray)")
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args(argv)
    result = run_node_loss(args.clients, args.max_tokens, down_s=args.down_s,
                           probe_clients=args.probe_clients, probe_tokens=args.probe_tokens,
                           autoscale=args.autoscale, temp_dir=args.temp_dir)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
