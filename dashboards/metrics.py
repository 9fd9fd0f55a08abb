"""Every iterserve metric in one place, and the stat logger that fills them.

Names and semantics follow vLLM (`vllm/v1/metrics/loggers.py`) under the ``iterserve:``
prefix, with vLLM's bucket edges, so dashboards and alerts written for vLLM translate by a
prefix swap. Labels are ``model_name`` and ``replica`` (plus ``finished_reason`` on
request_success); never a request id.

`--metrics-prefix vllm:` (the `prefix` argument) gives every metric vLLM also has vLLM's
exact name and label set (``model_name``, ``engine``="0", plus ``replica``), so dashboards,
KEDA scalers and llm-d's endpoint picker written for vLLM work unchanged; iterserve's own
metrics (out-of-blocks, router, autoscaler) keep the ``iterserve:`` prefix then. The one
name that differs between the two: the per-iteration token histogram is
``iterserve:iteration_tokens`` (promtool rejects ``_total`` on a non-counter) and
``vllm:iteration_tokens_total`` under vLLM's names. promtool reports "metric names should not
contain ':'" for every name, as it does for vLLM's; ``--metrics-prefix iterserve_`` gives
lint-clean output.

Gauges are set after every engine step and on the engine's idle tick (every
`replica/async_engine.py` IDLE_WAIT_S), so an idle replica's gauges are never stale; every
request that ends (stop, length, abort, error) is counted once in ``request_success``.

Use from the engine side::

    logger = PrometheusStatLogger("tiny-llama", replica_id="r0")
    logger.record(engine_stats, iteration_stats, finished)   # after every step

and from the ingress: ``metrics_text()`` for GET /metrics (content type `CONTENT_TYPE`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, get_args

from prometheus_client import CollectorRegistry

from iterserve.dashboards.kv_tier_metrics import (  # re-exported: one place for every name
    EXTERNAL_PREFIX_CACHE_HITS,
    EXTERNAL_PREFIX_CACHE_QUERIES,
    KV_DISK_ERRORS,
    KV_OFFLOAD_TOTAL_BYTES,
    KV_OFFLOAD_TOTAL_TIME,
    KV_TIER_HITS,
    KV_TIER_METRICS,
    KV_TIER_QUERIES,
    LABEL_TRANSFER_TYPE,
    TRANSFER_TYPES,
    KVTierRecorder,
)
from iterserve.dashboards.sinks import (
    CONTENT_TYPE,
    DEFAULT_PREFIX,
    LABEL_REPLICA,
    VLLM_ENGINE_INDEX,
    VLLM_ENGINE_LABEL,
    VLLM_PREFIX,
    MetricSink,
    MetricSpec,
    get_sink,
    mark_this_process_dead,
    prepare_multiprocess_dir,
)
from iterserve.dashboards.sinks import (
    metrics_text as _merged_metrics_text,
)

if TYPE_CHECKING:  # plain records; importing them at run time would pull in the engine package
    from iterserve.replica.stats import EngineStats, FinishedRequestStats, IterationStats

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_PREFIX",
    "METRIC_PREFIX",
    "VLLM_PREFIX",
    "ALL_METRICS",
    "AutoscalerMetrics",
    "PrometheusStatLogger",
    "RouterMetrics",
    "metric_name",
    "metrics_text",
    "translate_query",
    "prepare_multiprocess_dir",
    # the KV tiers' (dashboards/kv_tier_metrics.py)
    "EXTERNAL_PREFIX_CACHE_HITS",
    "EXTERNAL_PREFIX_CACHE_QUERIES",
    "KV_DISK_ERRORS",
    "KV_OFFLOAD_TOTAL_BYTES",
    "KV_OFFLOAD_TOTAL_TIME",
    "KV_TIER_HITS",
    "KV_TIER_QUERIES",
    "LABEL_TRANSFER_TYPE",
    "TRANSFER_TYPES",
]

METRIC_PREFIX = DEFAULT_PREFIX  # the name older callers import
LINT_CLEAN_PREFIX = "iterserve_"  # promtool warns on ':' in names; this one it accepts
# The --metrics-prefix choices (the default, vLLM's names, lint-clean), declared once.
MetricPrefix = Literal["iterserve:", "vllm:", "iterserve_"]
PREFIXES: tuple[str, ...] = get_args(MetricPrefix)

LABEL_MODEL = "model_name"
LABEL_FINISHED_REASON = "finished_reason"
# vLLM's FinishReason values, plus "error": a request that failed in the engine.
FINISH_REASONS = ("stop", "length", "abort", "error")
LABEL_OUTCOME = "outcome"
LABEL_STAGE = "stage"  # a replica's start-up stage (replica/startup.py STAGES)
# vLLM's lora_requests_info labels: the adapters as comma-joined names
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
# A router sync exchange: done; done but some peer events were dropped before this router
# read them; or the hub could not be reached.
SYNC_OUTCOMES = ("ok", "lost", "failed")
# holder_gone: the holder was not running or died under the pull (found at once, not at the
# timeout); failed: any other error (an unreachable holder, a full object store).
KV_PULL_OUTCOMES = ("pulled", "partial", "not_worth", "too_big", "evicted", "refused",
                    "timeout", "holder_gone", "failed")
_ENGINE_LABELS = (LABEL_MODEL, LABEL_REPLICA)

# vLLM's bucket edges (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                           4096.0, 8192.0, 16384.0)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`.

    >>> build_1_2_5_buckets(100)
    (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    """
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


TOKEN_COUNT_BUCKETS = build_1_2_5_buckets(131072)


def _gauge(key: str, doc: str, labels: tuple[str, ...] = _ENGINE_LABELS,
           mode: str = "livemostrecent", vllm: bool = True) -> MetricSpec:
    return MetricSpec(key, "gauge", doc, labels, multiprocess_mode=mode,
                      vllm_key=key if vllm else None)


def _counter(key: str, doc: str, labels: tuple[str, ...] = _ENGINE_LABELS,
             vllm: bool = True) -> MetricSpec:
    return MetricSpec(key, "counter", doc, labels, vllm_key=key if vllm else None)


def _histogram(key: str, doc: str, buckets: tuple[float, ...],
               vllm_key: str | None = None) -> MetricSpec:
    return MetricSpec(key, "histogram", doc, _ENGINE_LABELS, buckets=buckets,
                      vllm_key=vllm_key or key)


NUM_REQUESTS_RUNNING = _gauge("num_requests_running", "Number of requests in the running batch.")
NUM_REQUESTS_WAITING = _gauge(
    "num_requests_waiting", "Number of requests waiting to be scheduled (preempted included).")
KV_CACHE_USAGE_PERC = _gauge(
    "kv_cache_usage_perc", "KV-cache usage: used blocks / total blocks, 1 means 100 percent.")
NUM_PREEMPTIONS = _counter("num_preemptions", "Cumulative number of preemptions.")
NUM_OUT_OF_BLOCKS = _counter(
    "num_out_of_blocks", "Cumulative steps where a request could not get a KV block.",
    vllm=False)
PROMPT_TOKENS = _counter("prompt_tokens", "Number of prefill tokens processed.")
GENERATION_TOKENS = _counter("generation_tokens", "Number of generation tokens processed.")
PREFIX_CACHE_QUERIES = _counter(
    "prefix_cache_queries", "Prefix-cache queries, in prompt tokens looked up.")
PREFIX_CACHE_HITS = _counter(
    "prefix_cache_hits", "Prefix-cache hits on the device KV cache, in prompt tokens found.")
REQUEST_SUCCESS = _counter(
    "request_success", "Count of finished requests by finish reason.",
    labels=(*_ENGINE_LABELS, LABEL_FINISHED_REASON))
LORA_REQUESTS_INFO = _gauge(
    "lora_requests_info", "Running stats on LoRA requests: the adapters of the running and "
    "of the waiting requests as labels, the snapshot's time as the value (vLLM's).",
    labels=(*_ENGINE_LABELS, *LORA_INFO_LABELS))
ITERATION_TOKENS = _histogram(
    "iteration_tokens", "Histogram of tokens computed per engine step.", ITERATION_TOKEN_BUCKETS,
    vllm_key="iteration_tokens_total")
TIME_TO_FIRST_TOKEN = _histogram(
    "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
INTER_TOKEN_LATENCY = _histogram(
    "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
REQUEST_TIME_PER_OUTPUT_TOKEN = _histogram(
    "request_time_per_output_token_seconds",
    "Histogram of per-request decode time / (output tokens - 1) in seconds.", ITL_BUCKETS)
E2E_REQUEST_LATENCY = _histogram(
    "e2e_request_latency_seconds", "Histogram of arrival-to-finish latency in seconds.",
    REQUEST_LATENCY_BUCKETS)
REQUEST_QUEUE_TIME = _histogram(
    "request_queue_time_seconds", "Histogram of time spent waiting before first admission.",
    REQUEST_LATENCY_BUCKETS)
REQUEST_PREFILL_TIME = _histogram(
    "request_prefill_time_seconds", "Histogram of admission-to-first-token time in seconds.",
    REQUEST_LATENCY_BUCKETS)
REQUEST_DECODE_TIME = _histogram(
    "request_decode_time_seconds", "Histogram of first-token-to-finish time in seconds.",
    REQUEST_LATENCY_BUCKETS)
REQUEST_PROMPT_TOKENS = _histogram(
    "request_prompt_tokens", "Histogram of prompt tokens per finished request.",
    TOKEN_COUNT_BUCKETS)
REQUEST_GENERATION_TOKENS = _histogram(
    "request_generation_tokens", "Histogram of generated tokens per finished request.",
    TOKEN_COUNT_BUCKETS)
ROUTER_DECISIONS = _counter(
    "router_decisions", "Requests the router sent to each replica.", vllm=False)
ROUTER_SYNC_EXCHANGES = _counter(
    "router_sync_exchanges", "Router sync exchanges with the deployment's other routers, by "
    "outcome: ok, lost (some of their events dropped unread), failed (hub unreachable).",
    labels=(LABEL_MODEL, LABEL_OUTCOME), vllm=False)
REPLICA_STARTUP_SECONDS = _gauge(
    "replica_startup_seconds", "Seconds this replica's start-up spent in each stage (imports, "
    "model_config, tokenizer, weights_read, weights_place, weights_pack, kv_cache, graphs, "
    "engine_start).",
    labels=(*_ENGINE_LABELS, LABEL_STAGE), vllm=False)
REPLICA_STARTUP_BYTES_COPIED = _gauge(
    "replica_startup_bytes_copied", "Bytes each start-up stage of this replica wrote into new "
    "memory (dequantised or converted weights, parameters, oneDNN's packed copies, the zeroed "
    "KV cache).",
    labels=(*_ENGINE_LABELS, LABEL_STAGE), vllm=False)
KV_PULLS = _counter(
    "kv_pulls", "Prefix pulls this replica considered or made from another replica's KV, by "
    "outcome (KV_PULL_OUTCOMES): pulled, partial, not_worth, too_big, evicted, refused, "
    "timeout, holder_gone, failed; every outcome but pulled and partial computes the prefix.",
    labels=(*_ENGINE_LABELS, LABEL_OUTCOME), vllm=False)
KV_PULL_BYTES = _counter(
    "kv_pull_bytes", "KV bytes this replica received from other replicas' caches.",
    vllm=False)
# Per tenant, counted by the ingress (dashboards/tenant_metrics.py bounds the label's values).
LABEL_TENANT = "tenant"
_TENANT_LABELS = (LABEL_MODEL, LABEL_TENANT)
TENANT_REQUESTS = _counter(
    "tenant_requests", "Requests per tenant by outcome: admitted, or rate_limited (a 429 of "
    "the tenant's quota).", labels=(*_TENANT_LABELS, LABEL_OUTCOME), vllm=False)
TENANT_PROMPT_TOKENS = _counter(
    "tenant_prompt_tokens", "Prompt tokens of each tenant's requests.", labels=_TENANT_LABELS,
    vllm=False)
TENANT_GENERATION_TOKENS = _counter(
    "tenant_generation_tokens", "Tokens generated for each tenant.", labels=_TENANT_LABELS,
    vllm=False)
TENANT_TIME_TO_FIRST_TOKEN = MetricSpec(
    "tenant_time_to_first_token_seconds", "histogram", "Time to first token per tenant, as "
    "the ingress sees it (admitted to first token), in seconds.", _TENANT_LABELS,
    buckets=TTFT_BUCKETS)
AUTOSCALER_TARGET_REPLICAS = _gauge(
    "autoscaler_target_replicas", "Replica count the autoscaling policy asked for.",
    labels=(LABEL_MODEL,), mode="mostrecent", vllm=False)

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC, NUM_PREEMPTIONS,
    NUM_OUT_OF_BLOCKS, PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS,
    *KV_TIER_METRICS, REQUEST_SUCCESS, LORA_REQUESTS_INFO, ITERATION_TOKENS,
    TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY,
    REQUEST_TIME_PER_OUTPUT_TOKEN, E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME, REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS,
    REPLICA_STARTUP_SECONDS, REPLICA_STARTUP_BYTES_COPIED, KV_PULLS, KV_PULL_BYTES,
)
ALL_METRICS: tuple[MetricSpec, ...] = (
    *ENGINE_METRICS, ROUTER_DECISIONS, ROUTER_SYNC_EXCHANGES, AUTOSCALER_TARGET_REPLICAS,
    TENANT_REQUESTS, TENANT_PROMPT_TOKENS, TENANT_GENERATION_TOKENS, TENANT_TIME_TO_FIRST_TOKEN)


def metric_name(spec: MetricSpec, suffix: str = "", prefix: str = DEFAULT_PREFIX) -> str:
    """The stored series name: ``metric_name(TIME_TO_FIRST_TOKEN, "_bucket")``."""
    return spec.exposed_name(prefix) + suffix


def translate_query(expr: str, prefix: str) -> str:
    """A PromQL expression written with default names, rewritten for `prefix`'s names."""
    if prefix == DEFAULT_PREFIX:
        return expr
    renames: list[tuple[str, str]] = []
    for spec in ALL_METRICS:
        for suffix in ("_bucket", "_count", "_sum", ""):
            renames.append((metric_name(spec, suffix), metric_name(spec, suffix, prefix)))
    # Longest first, so that ``x_bucket`` is renamed before its stem ``x``.
    renames.sort(key=lambda pair: len(pair[0]), reverse=True)
    pattern = re.compile("|".join(re.escape(old) + r"(?![a-z0-9_])" for old, _ in renames))
    table = dict(renames)
    return pattern.sub(lambda match: table[match.group(0)], expr)


def metrics_text(registry: CollectorRegistry | None = None) -> bytes:
    """GET /metrics for the ingress: every process's iterserve metrics (multiprocess mode), or
    `registry` / the global registry in a single process."""
    return _merged_metrics_text(registry, name_prefixes=PREFIXES)


class PrometheusStatLogger:
    """A `StatLogger` (see replica/stats.py) that turns engine records into metrics.

    `registry` isolates tests; in production leave it None (the global registry, which is
    file-backed in multiprocess mode). `backend` is ``prometheus`` or ``ray`` (default: the
    ``ITERSERVE_METRICS_BACKEND`` environment variable, else ``prometheus``).
    """

    def __init__(
        self,
        model_name: str,
        replica_id: str,
        registry: CollectorRegistry | None = None,
        *,
        backend: str | None = None,
        prefix: str = METRIC_PREFIX,
    ) -> None:
        self._sink: MetricSink = get_sink(prefix, registry, backend)
        # vLLM's label set has `engine`; the sink keeps it only where vLLM's names are used.
        self._labels = {LABEL_MODEL: model_name, LABEL_REPLICA: str(replica_id),
                        VLLM_ENGINE_LABEL: VLLM_ENGINE_INDEX}
        self._last_preemptions = 0
        self._last_out_of_blocks = 0
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._kv_tiers = KVTierRecorder(self._sink, self._labels)
        self._create_series()

    def _create_series(self) -> None:
        """Expose every series from the start, so dashboards show zeros rather than gaps."""
        for spec in (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC):
            self._sink.gauge_set(spec, 0.0, self._labels)
        for spec in (NUM_PREEMPTIONS, NUM_OUT_OF_BLOCKS, PROMPT_TOKENS, GENERATION_TOKENS,
                     PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS):
            self._sink.counter_inc(spec, 0.0, self._labels)
        for reason in FINISH_REASONS:
            self._sink.counter_inc(REQUEST_SUCCESS, 0.0, self._reason_labels(reason))
        self._kv_tiers.create_series()
        for outcome in KV_PULL_OUTCOMES:
            self._sink.counter_inc(KV_PULLS, 0.0, {**self._labels, LABEL_OUTCOME: outcome})
        self._sink.counter_inc(KV_PULL_BYTES, 0.0, self._labels)

    def _reason_labels(self, reason: str) -> dict[str, str]:
        return {**self._labels, LABEL_FINISHED_REASON: reason}

    def _inc_cumulative(self, spec: MetricSpec, current: float, previous: float,
                        labels: dict[str, str] | None = None) -> float:
        """Counters from the engine's cumulative totals; a reset engine restarts from 0."""
        delta = current - previous if current >= previous else current
        if delta:
            self._sink.counter_inc(spec, float(delta), labels or self._labels)
        return current

    def record(
        self,
        engine: EngineStats,
        iteration: IterationStats,
        finished: list[FinishedRequestStats],
    ) -> None:
        sink, labels = self._sink, self._labels
        sink.gauge_set(NUM_REQUESTS_RUNNING, engine.num_running, labels)
        sink.gauge_set(NUM_REQUESTS_WAITING, engine.num_waiting, labels)
        sink.gauge_set(KV_CACHE_USAGE_PERC, engine.kv_usage, labels)
        self._last_preemptions = self._inc_cumulative(
            NUM_PREEMPTIONS, engine.num_preemptions, self._last_preemptions)
        self._last_out_of_blocks = self._inc_cumulative(
            NUM_OUT_OF_BLOCKS, engine.num_out_of_blocks, self._last_out_of_blocks)
        self._last_prefix_queries = self._inc_cumulative(
            PREFIX_CACHE_QUERIES, engine.prefix_cache_queries, self._last_prefix_queries)
        self._last_prefix_hits = self._inc_cumulative(
            PREFIX_CACHE_HITS, engine.prefix_cache_hits, self._last_prefix_hits)
        self._kv_tiers.record(engine)
        if engine.max_loras:
            sink.gauge_set(LORA_REQUESTS_INFO, engine.timestamp, {
                **labels, "max_lora": str(engine.max_loras),
                "running_lora_adapters": ",".join(engine.running_lora_adapters),
                "waiting_lora_adapters": ",".join(engine.waiting_lora_adapters)})

        if iteration.num_prompt_tokens:
            sink.counter_inc(PROMPT_TOKENS, iteration.num_prompt_tokens, labels)
        if iteration.num_generation_tokens:
            sink.counter_inc(GENERATION_TOKENS, iteration.num_generation_tokens, labels)
        step_tokens = iteration.num_prompt_tokens + iteration.num_generation_tokens
        if step_tokens:
            sink.histogram_observe(ITERATION_TOKENS, step_tokens, labels)
        for ttft in iteration.time_to_first_tokens_s:
            sink.histogram_observe(TIME_TO_FIRST_TOKEN, ttft, labels)
        for itl in iteration.inter_token_latencies_s:
            sink.histogram_observe(INTER_TOKEN_LATENCY, itl, labels)
        for request in finished:
            self._record_finished(request)

    def _record_finished(self, request: FinishedRequestStats) -> None:
        sink, labels = self._sink, self._labels
        sink.counter_inc(REQUEST_SUCCESS, 1.0, self._reason_labels(request.finish_reason))
        sink.histogram_observe(E2E_REQUEST_LATENCY, request.e2e_latency_s, labels)
        sink.histogram_observe(REQUEST_QUEUE_TIME, request.queue_time_s, labels)
        sink.histogram_observe(REQUEST_PREFILL_TIME, request.prefill_time_s, labels)
        sink.histogram_observe(REQUEST_DECODE_TIME, request.decode_time_s, labels)
        sink.histogram_observe(REQUEST_PROMPT_TOKENS, request.num_prompt_tokens, labels)
        sink.histogram_observe(REQUEST_GENERATION_TOKENS, request.num_generation_tokens, labels)
        if request.num_generation_tokens > 1:
            tpot = request.decode_time_s / (request.num_generation_tokens - 1)
            sink.histogram_observe(REQUEST_TIME_PER_OUTPUT_TOKEN, tpot, labels)

    def record_startup(self, stages: Mapping[str, Mapping[str, float]]) -> None:
        """The replica's start-up, once: {stage: {"seconds", "bytes_copied", ...}}."""
        for stage, record in stages.items():
            labels = {**self._labels, LABEL_STAGE: stage}
            self._sink.gauge_set(REPLICA_STARTUP_SECONDS, record["seconds"], labels)
            self._sink.gauge_set(REPLICA_STARTUP_BYTES_COPIED, record["bytes_copied"], labels)

    def record_kv_pull(self, outcome: str, nbytes: int) -> None:
        """One prefix pull (deploy/kv_pull.py) by its outcome, and the bytes it received."""
        if outcome not in KV_PULL_OUTCOMES:
            raise ValueError(f"pull outcome must be one of {KV_PULL_OUTCOMES}, got {outcome!r}")
        self._sink.counter_inc(KV_PULLS, 1.0, {**self._labels, LABEL_OUTCOME: outcome})
        self._sink.counter_inc(KV_PULL_BYTES, float(nbytes), self._labels)

    def close(self) -> None:
        """Call when the replica stops: its live gauges leave the shared metrics folder."""
        mark_this_process_dead()


class _ControlPlaneMetrics:
    """The router's and the autoscaler's metrics: a sink and the served model's label."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        backend: str | None = None,
        prefix: str = METRIC_PREFIX,
    ) -> None:
        self._sink = get_sink(prefix, registry, backend)
        self._model_name = model_name


class RouterMetrics(_ControlPlaneMetrics):
    """For the request router: one counter increment per routing decision, and one per
    router sync exchange where sync is on."""

    def record_decision(self, replica_id: str) -> None:
        labels = {LABEL_MODEL: self._model_name, LABEL_REPLICA: str(replica_id)}
        self._sink.counter_inc(ROUTER_DECISIONS, 1.0, labels)

    def record_sync_exchange(self, outcome: str) -> None:
        """One router sync exchange (RouterConfig.router_sync_period_s): SYNC_OUTCOMES."""
        if outcome not in SYNC_OUTCOMES:
            raise ValueError(f"sync outcome must be one of {SYNC_OUTCOMES}, got {outcome!r}")
        labels = {LABEL_MODEL: self._model_name, LABEL_OUTCOME: outcome}
        self._sink.counter_inc(ROUTER_SYNC_EXCHANGES, 1.0, labels)


class AutoscalerMetrics(_ControlPlaneMetrics):
    """For the autoscaling policy: the replica count it asked for, each time it decides."""

    def set_target_replicas(self, target_replicas: float) -> None:
        self._sink.gauge_set(AUTOSCALER_TARGET_REPLICAS, float(target_replicas),
                             {LABEL_MODEL: self._model_name})
