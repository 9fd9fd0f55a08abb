"""Metrics that tell the truth, end to end (issue 14 part 1): a real `iterserve serve` (Ray
Serve, simulated runner: a step is a 20 ms sleep, so the 2-core box is not the bottleneck)
scraped by a real Prometheus every second, for 1 replica (``iterserve:`` names) and for 2
replicas (``--metrics-prefix vllm:``, vLLM's names).

* Under steady streaming load, every Prometheus sample of running / waiting / KV usage lies
  within the range the engines themselves reported (GET /debug/replicas, polled meanwhile)
  within a stats period of its scrape, widened by the largest move between two polls.
* After a disconnect storm (96 streams, max_tokens 400, each read 2-6 chunks then hung up) and
  after load stops, GET /metrics agrees with /debug/replicas within two stats periods, and
  request_success_total sums to the requests sent, by reason (abort: the storm; length: the
  load, which ignores EOS). Prometheus's next scrape agrees too.

Needs the prometheus binary (bash dashboards/install_prometheus.sh). Run under the heavy lock.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from iterserve.dashboards import metrics, provisioning
from iterserve.loadtests.servers import free_port, server_env, stop_server, wait_until_ready
from iterserve.loadtests.studies.reliability.chaos import run_request
from iterserve.loadtests.studies.reliability.metrics_truth import (
    finished_totals,
    hangup_storm,
    metrics_view,
    snapshot,
    wait_for_agreement,
)
from iterserve.replica.async_engine import IDLE_WAIT_S

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed: "
                       "run bash dashboards/install_prometheus.sh"),
]
STATS_PERIOD_S = IDLE_WAIT_S  # the idle tick; a busy engine records after every (shorter) step
SIM_COST = json.dumps({"a_s": 0.02})
SERVE_ARGS = ["--simulate", "--sim-cost-model", SIM_COST, "--max-model-len", "1024",
              "--num-gpu-blocks-override", "1024", "--max-num-seqs", "32"]
NUM_HANGUPS = 96
LOAD_STREAMS = 12
LOAD_SECONDS = 8.0
LOAD_MAX_TOKENS = 40
POLL_SLACK_S = 0.5  # how far apart a /debug/replicas answer and its snapshot may be


@pytest.fixture(params=[(1, metrics.DEFAULT_PREFIX), (2, metrics.VLLM_PREFIX)],
                ids=["1-replica-iterserve", "2-replicas-vllm"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, int, str]]:
    num_replicas, prefix = request.param
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "iterserve.deploy.cli", "serve", "--port", str(port),
               "--num-replicas", str(num_replicas), "--metrics-prefix", prefix, *SERVE_ARGS]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=server_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process, log_path, None)
        deadline = time.monotonic() + 120
        while len(httpx.get(f"{url}/debug/replicas", timeout=30).json()["data"]) < num_replicas:
            assert time.monotonic() < deadline, "replicas did not all come up"
            time.sleep(1)
        yield url, num_replicas, prefix
    finally:
        stop_server(process)


@pytest.fixture()
def prometheus(server: tuple[str, int, str], tmp_path: Path) -> Iterator[str]:
    target = server[0].removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(provisioning.embedded_config(target, scrape_interval="1s")))
    address = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={address}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{address}"
    try:
        deadline = time.monotonic() + 30
        while not _query(url, 'up{job="iterserve"} == 1'):
            assert time.monotonic() < deadline, "prometheus did not scrape the server"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _query(prometheus_url: str, expr: str) -> list[dict[str, Any]]:
    try:
        response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
    except httpx.HTTPError:
        return []
    if response.status_code != 200:  # 503 "Service Unavailable" while Prometheus starts
        return []
    return response.json().get("data", {}).get("result", [])


class EnginePoller:
    """Polls /debug/replicas in a thread: (snapshot time, replica, running, waiting, kv)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rows: list[tuple[float, str, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                for info in client.get("/debug/replicas").json()["data"]:
                    s = info["stats"]
                    self.rows.append((s["timestamp"], str(info["replica_id"]), s["num_running"],
                                      s["num_waiting"], s["kv_usage"]))

    def __enter__(self) -> EnginePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def range_before(self, replica: str, at: float, column: int) -> tuple[float, float] | None:
        """What the engine can have reported within one stats period (plus the poll's slack)
        around a scrape at `at`: the range of the polled answers there, widened by the largest
        move between two consecutive answers (a value that changes every 20 ms step can peak
        between two polls, and on a loaded box the HTTP poll is sparse). None when the poller
        has fewer than two answers there: one answer bounds nothing."""
        values = [row[column] for row in self.rows if row[1] == replica
                  and at - STATS_PERIOD_S - POLL_SLACK_S <= row[0]
                  <= at + STATS_PERIOD_S + POLL_SLACK_S]
        if len(values) < 2:
            return None
        between_polls = max(abs(b - a) for a, b in itertools.pairwise(values))
        return min(values) - between_polls, max(values) + between_polls


async def _steady_load(url: str, seconds: float) -> int:
    """LOAD_STREAMS closed-loop streaming clients for `seconds`; returns requests sent."""
    deadline = time.monotonic() + seconds
    sent = 0

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        nonlocal sent
        while time.monotonic() < deadline:
            sent += 1
            body = {"prompt": f"load {index} {sent}", "max_tokens": LOAD_MAX_TOKENS,
                    "stream": True, "ignore_eos": True}
            outcome = await run_request(client, body)
            assert outcome.ok and outcome.finish_reason == "length", outcome

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(LOAD_STREAMS)))
    return sent


def test_metrics_agree_with_the_engines(server: tuple[str, int, str], prometheus: str) -> None:
    url, num_replicas, prefix = server
    names = {column: metrics.metric_name(spec, prefix=prefix) for column, spec in
             ((2, metrics.NUM_REQUESTS_RUNNING), (3, metrics.NUM_REQUESTS_WAITING),
              (4, metrics.KV_CACHE_USAGE_PERC))}

    # 1. Under load: each scraped sample lies within what the engine reported in the period
    #    before its scrape.
    checked, outside = 0, []
    with EnginePoller(url) as poller:
        load = asyncio.run(_steady_load(url, LOAD_SECONDS))
    for column, name in names.items():
        window = f"{name}[{int(LOAD_SECONDS)}s]"
        for series in _query(prometheus, window):
            replica = series["metric"]["replica"]
            for at, value in series["values"]:
                bounds = poller.range_before(replica, float(at), column)
                if bounds is None:
                    continue
                checked += 1
                if not bounds[0] - 1e-9 <= float(value) <= bounds[1] + 1e-9:
                    outside.append((name, replica, at, value, bounds))
    print(f"{num_replicas} replica(s) {prefix}: {load} load requests, {checked} samples "
          f"checked, {len(outside)} outside", outside[:5])
    assert checked >= 3 * num_replicas * len(names), "too few scrapes during the load"
    assert not outside, outside[:10]

    # 2. After load stops: /metrics agrees within two stats periods.
    waited, problems = wait_for_agreement(url, 2 * STATS_PERIOD_S + POLL_SLACK_S, prefix=prefix)
    print(f"after load: agreement after {waited:.3f}s")
    assert not problems, problems

    # 3. Disconnect storm, then the same agreement and the by-reason totals.
    outcomes = asyncio.run(hangup_storm(url, NUM_HANGUPS, 400))
    assert all(o.status == 200 and o.num_chunks >= 2 for o in outcomes)
    waited, problems = wait_for_agreement(url, 2 * STATS_PERIOD_S + POLL_SLACK_S, prefix=prefix)
    print(f"after storm: agreement after {waited:.3f}s")
    assert not problems, problems
    scraped, engines = snapshot(url, prefix=prefix)
    assert len(engines) == num_replicas
    totals = finished_totals(scraped)
    assert totals.get("abort") == NUM_HANGUPS, totals
    assert totals.get("length") == load, totals
    assert totals.get("stop", 0) == totals.get("error", 0) == 0, totals
    assert all(v.running == 0 and v.waiting == 0 and v.kv_usage == 0 for v in scraped.values())

    # 4. Prometheus's next scrape says the same.
    time.sleep(2.5)
    success = metrics.metric_name(metrics.REQUEST_SUCCESS, prefix=prefix)
    by_reason = {r["metric"]["finished_reason"]: float(r["value"][1])
                 for r in _query(prometheus, f"sum by (finished_reason) ({success})")}
    assert by_reason.get("abort") == NUM_HANGUPS and by_reason.get("length") == load, by_reason
    running = _query(prometheus, f"sum({names[2]})")
    assert float(running[0]["value"][1]) == 0.0
    assert metrics_view(httpx.get(f"{url}/metrics").text, prefix).keys() == engines.keys()
