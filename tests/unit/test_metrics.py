"""PrometheusStatLogger: vLLM semantics, label hygiene, exposition lint (promtool when present)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from iterserve.dashboards import kv_tier_metrics
from iterserve.dashboards import metrics as m
from iterserve.dashboards.tenant_metrics import OTHER_TENANTS, TenantLabels, TenantMetrics
from iterserve.replica.stats import EngineStats, FinishedRequestStats, IterationStats


def _engine(**overrides: float) -> EngineStats:
    values = dict(timestamp=0.0, num_running=3, num_waiting=2, num_total_blocks=100,
                  num_free_blocks=40, kv_usage=0.6, num_preemptions=0, num_out_of_blocks=0,
                  last_step_tokens=10, step_token_rate=100.0)
    values.update(overrides)
    return EngineStats(**values)


def _iteration(**overrides: object) -> IterationStats:
    values = dict(timestamp=0.0, step_time_s=0.01, num_prompt_tokens=30,
                  num_generation_tokens=3, num_scheduled_requests=4, num_preempted=0,
                  time_to_first_tokens_s=[0.03], inter_token_latencies_s=[0.02, 0.04])
    values.update(overrides)
    return IterationStats(**values)


def _finished(reason: str = "length", generated: int = 11) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, e2e_latency_s=1.2, queue_time_s=0.2,
                                prefill_time_s=0.1, decode_time_s=0.9,
                                time_to_first_token_s=0.3, num_prompt_tokens=64,
                                num_generation_tokens=generated, max_tokens=generated)


def _value(registry: CollectorRegistry, spec: m.MetricSpec, suffix: str = "",
           **labels: str) -> float | None:
    all_labels = {"model_name": "tiny", "replica": "r0", **labels}
    return registry.get_sample_value(m.metric_name(spec, suffix), all_labels)


@pytest.fixture()
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_every_series_exists_before_the_first_step(registry: CollectorRegistry) -> None:
    m.PrometheusStatLogger("tiny", "r0", registry=registry)
    assert _value(registry, m.NUM_REQUESTS_RUNNING) == 0.0
    assert _value(registry, m.NUM_PREEMPTIONS) == 0.0
    assert _value(registry, m.REQUEST_SUCCESS, finished_reason="abort") == 0.0


def test_record_follows_vllm_semantics(registry: CollectorRegistry) -> None:
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry)
    logger.record(_engine(num_preemptions=2, num_out_of_blocks=1), _iteration(), [])
    logger.record(_engine(num_preemptions=5, num_out_of_blocks=1, kv_usage=0.8),
                  _iteration(num_prompt_tokens=0), [_finished("length"), _finished("stop", 1)])

    assert _value(registry, m.KV_CACHE_USAGE_PERC) == 0.8
    assert _value(registry, m.NUM_REQUESTS_WAITING) == 2.0
    assert _value(registry, m.NUM_PREEMPTIONS) == 5.0  # cumulative engine totals, not sums
    assert _value(registry, m.NUM_OUT_OF_BLOCKS) == 1.0
    assert _value(registry, m.PROMPT_TOKENS) == 30.0
    assert _value(registry, m.GENERATION_TOKENS) == 6.0
    assert _value(registry, m.REQUEST_SUCCESS, finished_reason="length") == 1.0
    assert _value(registry, m.REQUEST_SUCCESS, finished_reason="stop") == 1.0
    assert _value(registry, m.TIME_TO_FIRST_TOKEN, "_count") == 2.0
    assert _value(registry, m.INTER_TOKEN_LATENCY, "_count") == 4.0
    assert _value(registry, m.E2E_REQUEST_LATENCY, "_sum") == pytest.approx(2.4)
    # TPOT only for requests with more than one output token: 0.9 / (11 - 1).
    assert _value(registry, m.REQUEST_TIME_PER_OUTPUT_TOKEN, "_count") == 1.0
    assert _value(registry, m.REQUEST_TIME_PER_OUTPUT_TOKEN, "_sum") == pytest.approx(0.09)
    assert _value(registry, m.ITERATION_TOKENS, "_bucket", le="32.0") == 1.0  # 33 tokens
    assert _value(registry, m.ITERATION_TOKENS, "_count") == 2.0


def test_host_tier_counters_per_tier_and_transfer_type(registry: CollectorRegistry) -> None:
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry)
    assert _value(registry, m.KV_OFFLOAD_TOTAL_BYTES, transfer_type="CPU_to_GPU") == 0.0
    logger.record(_engine(prefix_cache_queries=300, prefix_cache_hits=32, host_cache_queries=268,
                          host_cache_hits=160, kv_offload_bytes={"GPU_to_CPU": 4096,
                                                                 "CPU_to_GPU": 2048},
                          kv_offload_seconds={"GPU_to_CPU": 0.5, "CPU_to_GPU": 0.25}),
                  _iteration(), [])
    logger.record(_engine(prefix_cache_queries=300, prefix_cache_hits=32, host_cache_queries=300,
                          host_cache_hits=176, kv_offload_bytes={"GPU_to_CPU": 4096,
                                                                 "CPU_to_GPU": 3072},
                          kv_offload_seconds={"GPU_to_CPU": 0.5, "CPU_to_GPU": 0.375}),
                  _iteration(), [])
    assert _value(registry, m.PREFIX_CACHE_HITS) == 32.0  # the device tier
    assert _value(registry, m.EXTERNAL_PREFIX_CACHE_QUERIES) == 300.0  # the host tier
    assert _value(registry, m.EXTERNAL_PREFIX_CACHE_HITS) == 176.0
    assert _value(registry, m.KV_OFFLOAD_TOTAL_BYTES, transfer_type="CPU_to_GPU") == 3072.0
    assert _value(registry, m.KV_OFFLOAD_TOTAL_BYTES, transfer_type="GPU_to_CPU") == 4096.0
    assert _value(registry, m.KV_OFFLOAD_TOTAL_TIME, transfer_type="CPU_to_GPU") == 0.375


def test_disk_tier_counters_per_tier_reason_and_transfer_type(
        registry: CollectorRegistry) -> None:
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry)
    assert _value(registry, m.KV_TIER_HITS, tier="disk") == 0.0  # every series from the start
    assert _value(registry, m.KV_DISK_ERRORS, reason="disk_full") == 0.0
    logger.record(_engine(host_cache_queries=300, host_cache_hits=64, disk_cache_queries=236,
                          disk_cache_hits=160, disk_errors={"corrupt": 2, "disk_full": 0},
                          kv_offload_bytes={"CPU_to_DISK": 8192, "DISK_to_CPU": 4096},
                          kv_offload_seconds={"DISK_to_CPU": 0.125}),
                  _iteration(), [])
    assert _value(registry, m.EXTERNAL_PREFIX_CACHE_QUERIES) == 300.0  # what the device missed
    assert _value(registry, m.EXTERNAL_PREFIX_CACHE_HITS) == 224.0  # host and disk
    assert _value(registry, m.KV_TIER_QUERIES, tier="host") == 300.0
    assert _value(registry, m.KV_TIER_HITS, tier="host") == 64.0
    assert _value(registry, m.KV_TIER_QUERIES, tier="disk") == 236.0
    assert _value(registry, m.KV_TIER_HITS, tier="disk") == 160.0
    assert _value(registry, m.KV_DISK_ERRORS, reason="corrupt") == 2.0
    assert _value(registry, m.KV_OFFLOAD_TOTAL_BYTES, transfer_type="CPU_to_DISK") == 8192.0
    assert _value(registry, m.KV_OFFLOAD_TOTAL_TIME, transfer_type="DISK_to_CPU") == 0.125


def test_transfer_types_are_the_host_and_disk_tiers() -> None:
    from iterserve.replica.disk_kv_tier import DISK_ERRORS, DISK_TRANSFER_TYPES
    from iterserve.replica.host_kv_tier import TRANSFER_TYPES

    assert m.TRANSFER_TYPES == TRANSFER_TYPES + DISK_TRANSFER_TYPES
    assert kv_tier_metrics.DISK_ERRORS == DISK_ERRORS


def test_an_engine_restart_does_not_make_counters_go_backwards(
        registry: CollectorRegistry) -> None:
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry)
    logger.record(_engine(num_preemptions=4), _iteration(), [])
    logger.record(_engine(num_preemptions=1), _iteration(), [])
    assert _value(registry, m.NUM_PREEMPTIONS) == 5.0


def test_two_replicas_share_a_registry_with_their_own_series(
        registry: CollectorRegistry) -> None:
    first = m.PrometheusStatLogger("tiny", "r0", registry=registry)
    second = m.PrometheusStatLogger("tiny", "r1", registry=registry)
    first.record(_engine(num_running=1), _iteration(), [])
    second.record(_engine(num_running=7), _iteration(), [])
    assert _value(registry, m.NUM_REQUESTS_RUNNING) == 1.0
    assert _value(registry, m.NUM_REQUESTS_RUNNING, replica="r1") == 7.0


def test_router_and_autoscaler_metrics(registry: CollectorRegistry) -> None:
    router = m.RouterMetrics("tiny", registry=registry)
    for replica in ("r0", "r0", "r1"):
        router.record_decision(replica)
    m.AutoscalerMetrics("tiny", registry=registry).set_target_replicas(3)
    assert _value(registry, m.ROUTER_DECISIONS) == 2.0
    assert _value(registry, m.ROUTER_DECISIONS, replica="r1") == 1.0
    for outcome in ("ok", "ok", "failed"):
        router.record_sync_exchange(outcome)
    assert registry.get_sample_value(m.metric_name(m.ROUTER_SYNC_EXCHANGES),
                                     {"model_name": "tiny", "outcome": "ok"}) == 2.0
    with pytest.raises(ValueError, match="sync outcome"):
        router.record_sync_exchange("maybe")
    assert registry.get_sample_value(m.metric_name(m.AUTOSCALER_TARGET_REPLICAS),
                                     {"model_name": "tiny"}) == 3.0


def test_names_buckets_and_labels_follow_the_catalogue() -> None:
    names = [spec.key for spec in m.ALL_METRICS]
    assert len(names) == len(set(names))
    assert m.TIME_TO_FIRST_TOKEN.buckets[0] == 0.001 and m.TIME_TO_FIRST_TOKEN.buckets[-1] == 2560
    assert m.E2E_REQUEST_LATENCY.buckets == m.REQUEST_LATENCY_BUCKETS
    assert m.build_1_2_5_buckets(2048)[-1] == 2000.0
    for spec in m.ALL_METRICS:
        assert "model_name" in spec.labels
        assert not spec.key.endswith("_total"), "counters gain _total when exposed"
        if spec.kind == "histogram":
            assert list(spec.buckets) == sorted(spec.buckets)


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown metrics backend"):
        m.PrometheusStatLogger("tiny", "r0", backend="statsd")


def _exposition(prefix: str) -> str:
    registry = CollectorRegistry()
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry, prefix=prefix)
    logger.record(_engine(num_preemptions=1, max_loras=2, running_lora_adapters=("a", "b"),
                          waiting_lora_adapters=("c",)), _iteration(), [_finished()])
    logger.record_startup({"weights_place": {"seconds": 1.5, "bytes_copied": 2e9}})
    router = m.RouterMetrics("tiny", registry=registry, prefix=prefix)
    router.record_decision("r0")
    router.record_sync_exchange("ok")
    m.AutoscalerMetrics("tiny", registry=registry, prefix=prefix).set_target_replicas(2)
    tenants = TenantMetrics("tiny", registry=registry, prefix=prefix)
    tenants.record_request("acme", "admitted")
    tenants.record_first_token("acme", 0.05)
    tenants.record_tokens("acme", 20, 5)
    return m.metrics_text(registry).decode()


def test_exposition_parses_with_the_reference_parser() -> None:
    families = {family.name for family in text_string_to_metric_families(_exposition("iterserve:"))}
    for spec in m.ALL_METRICS:
        assert spec.name("iterserve:") in families


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed: run dashboards/install_prometheus.sh")


@needs_promtool
def test_promtool_passes_with_an_underscore_prefix() -> None:
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=_exposition("iterserve_"),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_reports_only_the_reserved_colon_with_the_vllm_style_prefix() -> None:
    # promtool flags ':' in every name, as it does for vLLM's `vllm:` metrics; nothing else.
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=_exposition(m.METRIC_PREFIX),
                            capture_output=True, text=True, timeout=30)
    findings = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    other = [line for line in findings if not line.endswith("metric names should not contain ':'")]
    assert other == []


_CHILD = """
import sys
from types import SimpleNamespace as Record  # duck-typed stats: no engine import, fast start
from prometheus_client import Gauge
from iterserve.dashboards import metrics as m
logger = m.PrometheusStatLogger("tiny", sys.argv[1])
engine = Record(num_running=int(sys.argv[2]), num_waiting=0, kv_usage=0.5, num_preemptions=0,
                num_out_of_blocks=0, prefix_cache_queries=0, prefix_cache_hits=0,
                host_cache_queries=0, host_cache_hits=0, kv_offload_bytes={},
                kv_offload_seconds={}, disk_cache_queries=0, disk_cache_hits=0, disk_errors={}, max_loras=0)
step = Record(num_prompt_tokens=30, num_generation_tokens=3, time_to_first_tokens_s=[0.1],
              inter_token_latencies_s=[])
logger.record(engine, step, [])
Gauge("foreign_process_metric", "from a process that is not ours").set(1)
if sys.argv[3] == "stop":
    logger.close()
"""

@pytest.mark.slow  # starts Python processes (about a second each on a loaded 2-core box)
def test_multiprocess_mode_merges_replica_processes(tmp_path, monkeypatch) -> None:
    """Replicas in other processes write to PROMETHEUS_MULTIPROC_DIR; metrics_text merges."""
    import os
    import sys

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    for replica, running, end in (("r0", "2", "keep"), ("r1", "5", "keep"), ("r2", "9", "stop")):
        subprocess.run([sys.executable, "-c", _CHILD, replica, running, end], env=env,
                       cwd=root, check=True, timeout=60)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    text = m.metrics_text().decode()
    samples = {(s.name, s.labels.get("replica")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    running = m.metric_name(m.NUM_REQUESTS_RUNNING)
    assert samples[(running, "r0")] == 2.0 and samples[(running, "r1")] == 5.0
    assert (running, "r2") not in samples, "a stopped replica's live gauges are dropped"
    assert samples[(m.metric_name(m.PROMPT_TOKENS), "r2")] == 30.0, "its counters stay"
    assert "foreign_process_metric" not in text


def test_tenant_labels_are_bounded_the_first_seen_keep_theirs() -> None:
    labels = TenantLabels(max_tenants=2)
    assert [labels.label(t) for t in ("a", "b", "c", "a", OTHER_TENANTS, "b")] == [
        "a", "b", OTHER_TENANTS, "a", OTHER_TENANTS, "b"]
    registry = CollectorRegistry()
    tenants = TenantMetrics("tiny", registry=registry, max_tenants=1)
    for name in ("a", "b", "c"):
        tenants.record_request(name, "admitted")
    tenants.record_request("a", "rate_limited")
    name = m.metric_name(m.TENANT_REQUESTS)
    assert registry.get_sample_value(name, {"model_name": "tiny", "tenant": "a",
                                            "outcome": "admitted"}) == 1.0
    assert registry.get_sample_value(name, {"model_name": "tiny", "tenant": OTHER_TENANTS,
                                            "outcome": "admitted"}) == 2.0
    assert registry.get_sample_value(name, {"model_name": "tiny", "tenant": "a",
                                            "outcome": "rate_limited"}) == 1.0
    with pytest.raises(ValueError):
        tenants.record_request("a", "maybe")
def test_lora_requests_info_names_the_running_and_waiting_adapters() -> None:
    registry = CollectorRegistry()
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry)
    logger.record(_engine(timestamp=123.0, max_loras=4, running_lora_adapters=("a", "b"),
                          waiting_lora_adapters=("c",)), _iteration(), [])
    labels = {"model_name": "tiny", "replica": "r0", "max_lora": "4",
              "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert registry.get_sample_value(m.metric_name(m.LORA_REQUESTS_INFO), labels) == 123.0
