"""Every dashboard query, evaluated by a real Prometheus scraping a real `iterserve serve`.

Starts the server (embedded Ray, tiny model, CPU) and Debian's Prometheus with a 1 s scrape
of the server's GET /metrics (the generated embedded config, retargeted), sends a short
bounded load, then runs each panel query through Prometheus's HTTP API: every query must
parse, and every query of the engine and of the router (the app routes with KVAwareRouter
by default) must return data. Autoscaler and GPU queries must parse; they return data only
with num_replicas=auto and on a GPU.
Also lints the live exposition with promtool. Skips when the prometheus binary is missing
(install it with dashboards/install_prometheus.sh).
"""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import dashboard_queries
import httpx
import pytest
import yaml

from iterserve.autoscale.sim.workload import LengthBucket, OutputLengths, make_workload
from iterserve.dashboards import metrics, provisioning
from iterserve.loadtests.bench_client import run_level
from iterserve.loadtests.servers import free_port, serve_mode

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = [
    pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420),
    pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                       reason="prometheus/promtool not installed: "
                              "run bash dashboards/install_prometheus.sh"),
]
SERVE_ARGS = ["--max-model-len", "1024", "--num-gpu-blocks-override", "256",
              "--max-num-seqs", "16", "--device", "cpu"]
RATE_WINDOW = "1m"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs = tmp_path_factory.mktemp("serve-logs")
    with serve_mode("continuous", SERVE_ARGS, logs, api_key=None) as (url, info):
        yield url, info["id"]


@pytest.fixture(scope="module")
def prometheus(server: tuple[str, str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("prometheus")
    target = server[0].removeprefix("http://")
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(provisioning.embedded_config(target, scrape_interval="1s")))
    checked = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    address = f"127.0.0.1:{free_port()}"
    log = open(folder / "prometheus.log", "wb")
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address={address}", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _up(f"http://{address}"), 30, "prometheus did not scrape the server")
        yield f"http://{address}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _wait_for(condition: object, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise TimeoutError(message)


def _query(prometheus_url: str, expr: str) -> dict:
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
    return response.json() | {"http_status": response.status_code}


def _up(prometheus_url: str) -> bool:
    try:
        response = httpx.get(f"{prometheus_url}/api/v1/query",
                             params={"query": 'up{job="iterserve"} == 1'}, timeout=10)
    except httpx.HTTPError:
        return False
    if response.status_code != 200:  # a plain-text 503 "Service Unavailable" while it starts
        return False
    return bool(response.json().get("data", {}).get("result"))


def _generated_tokens(prometheus_url: str) -> float:
    result = _query(prometheus_url, f"sum({metrics.metric_name(metrics.GENERATION_TOKENS)})")
    values = result["data"]["result"]
    return float(values[0]["value"][1]) if values else 0.0


def _send_load(url: str, model: str) -> None:
    workload = make_workload(24, seed=0, prompt_buckets=(LengthBucket("short", 16, 96, 1.0),),
                             output_lengths=OutputLengths.uniform(8, 48))
    run = asyncio.run(run_level(url, model, workload, concurrency=6))
    assert all(result.ok for result in run.results), [r.timing.error for r in run.results]


def test_every_panel_query_runs_on_prometheus(server: tuple[str, str], prometheus: str) -> None:
    url, model = server
    _send_load(url, model)
    _wait_for(lambda: _generated_tokens(prometheus) > 0, 30, "no generation tokens scraped")
    # A second wave after Prometheus has seen the first: rate() needs a series to grow
    # between two scrapes, and on a slow box the whole first wave can land in one.
    first_wave = _generated_tokens(prometheus)
    _send_load(url, model)
    _wait_for(lambda: _generated_tokens(prometheus) > first_wave, 30,
              "the second wave was not scraped")
    time.sleep(3)  # a few more 1 s scrapes, so every rate() window holds several points

    empty, failed = [], []
    for panel, target in dashboard_queries.all_targets():
        expr = dashboard_queries.render_query(target.expr, model_name=model, rate_interval=RATE_WINDOW)
        result = _query(prometheus, expr)
        if result["http_status"] != 200 or result.get("status") != "success":
            failed.append(f"{panel.title} / {target.legend}: {result.get('error')} :: {expr}")
            continue
        values = [float(series["value"][1]) for series in result["data"]["result"]]
        if target.requires in ("engine", "router") and not any(math.isfinite(v) for v in values):
            empty.append(f"{panel.title} / {target.legend}: {values} :: {expr}")
    assert failed == [], "queries Prometheus rejected:\n" + "\n".join(failed)
    assert empty == [], "engine or router queries without data:\n" + "\n".join(empty)


def test_live_exposition_passes_promtool_but_for_the_reserved_colon(
        server: tuple[str, str]) -> None:
    # A labelled histogram has no series until its first observation: serve one request
    # here so the test does not depend on another test's load having run first.
    url, model = server
    served = httpx.post(f"{url}/v1/completions", timeout=120,
                        json={"model": model, "prompt": "hello", "max_tokens": 4})
    assert served.status_code == 200, served.text
    bucket = metrics.metric_name(metrics.TIME_TO_FIRST_TOKEN, "_bucket")
    # The replica publishes its metrics on its stats tick, so the observation may take a tick
    # to appear.
    deadline = time.monotonic() + 10
    text = httpx.get(f"{url}/metrics", timeout=10).text
    while bucket not in text and time.monotonic() < deadline:
        time.sleep(0.5)
        text = httpx.get(f"{url}/metrics", timeout=10).text
    assert bucket in text
    linted = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=30)
    findings = [line for line in (linted.stdout + linted.stderr).splitlines() if line.strip()]
    assert [f for f in findings if not f.endswith("metric names should not contain ':'")] == []


def test_generated_configs_pass_promtool(tmp_path: Path) -> None:
    dashboards_dir = Path(provisioning.__file__).parent
    for name in ("prometheus-embedded.yml", "prometheus-ray.yml"):
        checked = subprocess.run([PROMTOOL, "check", "config", str(dashboards_dir / name)],
                                 capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stdout + checked.stderr
