"""The cluster path: `ray` metrics backend -> Ray's metrics agent -> Prometheus via file_sd.

A Ray worker records through `PrometheusStatLogger` with ITERSERVE_METRICS_BACKEND=ray; Ray's
head writes its service-discovery file; a real Prometheus runs the generated
`prometheus-ray.yml` (pointed at a copy of that file, since other Ray sessions on a shared
machine may rewrite the global one) and must store the series under the `iterserve:` names
the dashboard queries, not Ray's `ray_iterserve_` ones. Skips without the prometheus binary.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from iterserve.dashboards import metrics, provisioning
from iterserve.loadtests.servers import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed: "
                       "run bash dashboards/install_prometheus.sh"),
]


def _discovered_targets(export_port: int) -> list[dict] | None:
    path = Path(provisioning.RAY_SERVICE_DISCOVERY_FILE)
    if not path.is_file():
        return None
    try:
        groups = json.loads(path.read_text())
    except json.JSONDecodeError:  # being rewritten right now
        return None
    ours = [g for g in groups if any(t.endswith(f":{export_port}") for t in g["targets"])]
    return ours or None


def _poll(check: object, timeout_s: float, message: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()  # type: ignore[operator]
        if value:
            return value
        time.sleep(1.0)
    raise TimeoutError(message)


def _record_with_ray_backend() -> bool:
    from types import SimpleNamespace as Record

    from iterserve.dashboards.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("tiny", "r0")  # backend from ITERSERVE_METRICS_BACKEND
    engine = Record(num_running=3, num_waiting=1, kv_usage=0.25, num_preemptions=2,
                    num_out_of_blocks=0, prefix_cache_queries=0, prefix_cache_hits=0,
                    host_cache_queries=0, host_cache_hits=0, kv_offload_bytes={},
                    kv_offload_seconds={}, disk_cache_queries=0, disk_cache_hits=0,
                    disk_errors={}, max_loras=0)
    step = Record(num_prompt_tokens=40, num_generation_tokens=4, time_to_first_tokens_s=[0.2],
                  inter_token_latencies_s=[0.03])
    logger.record(engine, step, [])
    return True


def test_ray_backend_series_reach_prometheus_under_iterserve_names(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    export_port = free_port()
    ray.init(num_cpus=1, include_dashboard=True, _metrics_export_port=export_port,
             runtime_env={"env_vars": {"ITERSERVE_METRICS_BACKEND": "ray"}},
             log_to_driver=False)
    prometheus = None
    try:
        # This module is not importable in Ray workers: ship its functions by value.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

        @ray.remote(num_cpus=0)
        class Replica:  # an actor, so the worker (and its metrics) stays alive meanwhile
            def record(self) -> bool:
                return _record_with_ray_backend()

        replica = Replica.remote()
        assert ray.get(replica.record.remote())
        groups = _poll(lambda: _discovered_targets(export_port), 90,
                       "Ray did not list its metrics agent in the discovery file")
        discovery = tmp_path / "discovery.json"
        discovery.write_text(json.dumps(groups))
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(
            provisioning.ray_cluster_config(str(discovery), scrape_interval="1s")))
        address = f"127.0.0.1:{free_port()}"
        prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={address}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def query(expr: str) -> list[dict]:
            try:
                response = httpx.get(f"http://{address}/api/v1/query", params={"query": expr},
                                     timeout=5)
            except httpx.HTTPError:
                return []
            if response.status_code != 200:  # a plain-text 503 while Prometheus starts
                return []
            return response.json().get("data", {}).get("result", [])

        running = metrics.metric_name(metrics.NUM_REQUESTS_RUNNING)
        found = _poll(lambda: query(f'{running}{{replica="r0"}}'), 120,
                      f"{running} never reached Prometheus")
        assert float(found[0]["value"][1]) == 3.0
        assert found[0]["metric"]["model_name"] == "tiny"
        ttft_count = metrics.metric_name(metrics.TIME_TO_FIRST_TOKEN, "_count")
        assert _poll(lambda: query(f"sum({ttft_count})"), 30, "no TTFT histogram")
        prompt = metrics.metric_name(metrics.PROMPT_TOKENS)
        assert float(_poll(lambda: query(f"sum({prompt})"), 30, "no counter")[0]["value"][1]) > 0
        assert query('{__name__=~"ray_iterserve_.+"}') == [], "relabelling left Ray's names"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        ray.shutdown()
