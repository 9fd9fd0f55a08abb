"""Planned disruption through `serve deploy` of changed YAML configs, under streaming load.

    python -m iterserve.loadtests.studies.reliability.serve_deploy_disruption [--clients 8] [--max-tokens 120]
        [--long-tokens 1500] [--temp-dir /tmp/ray_sd] [--json out.json]

A local Ray with its dashboard (the REST API `serve deploy` talks to) on free ports. Three
configs of the same application (`import_path: iterserve.deploy.app:build_app`), each sent
with Ray's own CLI, `serve deploy CONFIG.yaml --address http://127.0.0.1:<dashboard>`:

  v1  num_replicas 2
  v2  num_replicas 1                       (scale-down)
  v3  num_replicas 1, max_num_seqs 8 -> 12 (rolling redeploy: a changed engine setting)

A changed `args:` changes the application's code version, so Serve replaces every deployment,
the ingress as well as the replicas: each stopping replica, of either deployment, must drain
what it carries. `--clients` closed-loop streams of `--max-tokens` run throughout; one more
client starts a long stream (`--long-tokens`, 20 ms a step: 30 s or more) just before the
redeploy, so that the stopping ingress and replica carry a generation longer than Serve's
default graceful_shutdown_timeout_s (20 s). Floor: every stream ends 200 with all its tokens
and [DONE]. The result (JSON) holds the timeline, every failure, the long streams' spans and
which ingress and replica actors ran before and after each step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from iterserve.loadtests.servers import free_port, interrupt_on_termination
from iterserve.loadtests.studies.reliability.disruption import StreamingLoad, Timeline

APP_NAME = "iterserve"
SIM_COST = {"a_s": 0.02}  # a step is a 20 ms sleep
SIM_ENGINE: dict[str, Any] = {"model": "iterserve-tiny", "runner": "simulated",
                              "simulator": json.dumps(SIM_COST), "max_model_len": 2048,
                              "num_gpu_blocks_override": 256, "max_num_seqs": 8}
SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S = 20.0
SETTLE_S = 4.0


def app_config(port: int, num_replicas: int, engine: dict[str, Any]) -> dict[str, Any]:
    """A Serve config file's content: one application, `build_app` with these args."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": APP_NAME, "route_prefix": "/",
            "import_path": "iterserve.deploy.app:build_app",
            "args": {"num_replicas": num_replicas, "router": "kv", "engine_kwargs": engine},
        }],
    }


def serve_deploy(config: dict[str, Any], path: Path, dashboard: str) -> None:
    """Write `config` as YAML and send it with Ray's CLI (`serve deploy`)."""
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "ray.serve.scripts", "deploy", str(path),
               "--address", dashboard]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"serve deploy failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _replica_configs(url: str) -> list[dict[str, Any]]:
    try:
        response = httpx.get(f"{url}/debug/replicas", timeout=10)
        return [info["config"] for info in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _app_running() -> bool:
    from ray import serve

    status = serve.status().applications.get(APP_NAME)
    return status is not None and str(getattr(status.status, "value", status.status)) \
        == "RUNNING"


def _serve_actors() -> dict[str, list[str]]:
    """Live ingress and replica actors (their Serve replica ids), read from the GCS."""
    import ray

    actors: dict[str, list[str]] = {"OpenAIIngress": [], "LLMReplica": []}
    for info in ray._private.state.actors().values():  # no public GCS reader in Ray 2.60
        name = info.get("Name") or ""
        if info.get("State") != "ALIVE":
            continue
        for deployment in actors:
            if f"{deployment}#" in name:
                actors[deployment].append(name.rsplit("#", 1)[-1])
    return {k: sorted(v) for k, v in actors.items()}


def _spans(load: StreamingLoad, started: float) -> list[tuple[float, float]]:
    return [(round(o.started - started, 2), round(o.ended - started, 2)) for o in load.outcomes]


def run_serve_deploy_disruption(clients: int = 8, max_tokens: int = 120,
                                long_tokens: int = 1500, temp_dir: str | None = None,
                                work_dir: Path | None = None) -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    work = work_dir or Path(temp_dir or "/tmp") / "serve_deploy_configs"
    work.mkdir(parents=True, exist_ok=True)
    dashboard_port, port = free_port(), free_port()
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    url = f"http://127.0.0.1:{port}"
    init_args: dict[str, Any] = {"num_cpus": 8, "include_dashboard": True,
                                 "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port,
                                 "log_to_driver": False, "object_store_memory": 128 * 1024**2}
    if temp_dir is not None:
        init_args["_temp_dir"] = temp_dir
    ray.init(**init_args)
    interrupt_on_termination()  # a SIGTERM still shuts this cluster down (servers.py)
    changed_engine = {**SIM_ENGINE, "max_num_seqs": 12}
    actors: dict[str, dict[str, list[str]]] = {}
    try:
        serve_deploy(app_config(port, 2, SIM_ENGINE), work / "v1.yaml", dashboard)
        _wait_for(lambda: len(_replica_configs(url)) == 2 and _app_running(), 300,
                  "v1: two replicas")
        actors["v1"] = _serve_actors()
        timeline = Timeline()
        with StreamingLoad(url, clients, max_tokens) as load:
            load_started = timeline.start
            timeline.mark(f"load started ({clients} streaming clients, {max_tokens} tokens)")
            time.sleep(SETTLE_S)
            timeline.mark(f"scale-down 2 -> 1: serve deploy v2.yaml ({load.completed()} "
                          "streams done)")
            serve_deploy(app_config(port, 1, SIM_ENGINE), work / "v2.yaml", dashboard)
            timeline.mark("scale-down: serve deploy returned")
            _wait_for(lambda: len(_replica_configs(url)) == 1 and _app_running(), 300,
                      "v2: one replica")
            actors["v2"] = _serve_actors()
            timeline.mark("scale-down: one replica answers, application RUNNING")
            time.sleep(SETTLE_S)
            with StreamingLoad(url, 1, long_tokens, timeout_s=300) as long_load:
                timeline.mark(f"long stream started ({long_tokens} tokens)")
                time.sleep(2.0)
                long_load.stop_sending()  # the stream under way is the only long one
                redeploy_at = timeline.mark(
                    f"rolling redeploy: serve deploy v3.yaml, max_num_seqs 8 -> 12 "
                    f"({load.completed()} streams done)")
                serve_deploy(app_config(port, 1, changed_engine), work / "v3.yaml",
                             dashboard)
                timeline.mark("redeploy: serve deploy returned")
                _wait_for(lambda: [c["max_num_seqs"] for c in _replica_configs(url)] == [12]
                          and _app_running(), 300, "v3: only the new replica")
                actors["v3"] = _serve_actors()
                timeline.mark("redeploy: only the new replica answers, application RUNNING")
                time.sleep(SETTLE_S)
                timeline.mark("load stopping")
                load.stop_sending()
            timeline.mark(f"long stream ended: {long_load.completed()} of "
                          f"{len(long_load.outcomes)} complete")
            actors["end"] = _serve_actors()
        timeline.mark(f"load stopped: {len(load.outcomes)} sent, {load.completed()} complete")
        long_spans = _spans(long_load, load_started)
        return {
            "timeline": timeline.events,
            "requests": len(load.outcomes), "complete": load.completed(),
            "failures": load.failures()[:20],
            "long_streams": len(long_load.outcomes), "long_complete": long_load.completed(),
            "long_failures": long_load.failures(),
            "long_stream_spans_s": long_spans,
            "long_stream_after_redeploy_s": [round(end - redeploy_at, 2)
                                             for start, end in long_spans if start < redeploy_at],
            "serve_default_graceful_shutdown_s": SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S,
            "actors": actors,
            "configs": {name: str(work / f"{name}.yaml") for name in ("v1", "v2", "v3")},
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8,
                        help="closed-loop streaming clients during the redeploys")
    parser.add_argument("--max-tokens", type=int, default=120, help="tokens each stream asks for")
    parser.add_argument("--long-tokens", type=int, default=1500,
                        help="tokens of the one long stream that must survive a redeploy")
    parser.add_argument("--temp-dir", default=None,
                        help="Ray's temp folder for this cluster (default /tmp/ray)")
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args(argv)
    result = run_serve_deploy_disruption(args.clients, args.max_tokens, args.long_tokens,
                                         args.temp_dir)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
