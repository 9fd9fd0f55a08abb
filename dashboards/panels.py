"""The dashboard's panels and their PromQL: the one source of truth.

`grafana.py` turns these into Grafana JSON; the Prometheus integration test evaluates every
query against a real Prometheus. Metric names come from `metrics.py` only.

Grafana variables used in queries: ``$model_name`` (multi-value, so ``=~``) and
``$__rate_interval``. `Target.requires` names what must be running for the query to return
data: ``engine`` (any iterserve replica), ``host_tier`` (a replica with a host KV tier:
kv_offloading_size set), ``disk_tier`` (one with a disk KV tier under it:
kv_offloading_disk_path set), ``router``, ``autoscaler``, ``gpu`` (an NVML exporter: DCGM,
nvidia_gpu_exporter, or Ray's node metrics on a GPU node), ``tenants`` (an ingress that has
served a completion: the per-tenant series appear with the first).
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.dashboards import metrics as m

REQUIREMENTS = ("engine", "host_tier", "disk_tier", "router", "autoscaler", "gpu", "tenants")
DEFAULT_KV_WATERMARK = 0.9  # the line drawn on the KV-usage panel


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str
    requires: str = "engine"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    width: int = 12
    height: int = 8
    max_value: float | None = None
    threshold_line: float | None = None  # drawn as a dashed line (e.g. the KV watermark)
    stacked: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


SELECTOR = '{model_name=~"$model_name"}'
RATE = "[$__rate_interval]"


def _series(spec: m.MetricSpec, suffix: str = "") -> str:
    return m.metric_name(spec, suffix)


def _quantile(q: float, spec: m.MetricSpec, by: str = "le") -> str:
    bucket = _series(spec, "_bucket")
    return f"histogram_quantile({q}, sum by ({by}) (rate({bucket}{SELECTOR}{RATE})))"


def _mean(spec: m.MetricSpec) -> str:
    total, count = _series(spec, "_sum"), _series(spec, "_count")
    return f"sum(rate({total}{SELECTOR}{RATE})) / sum(rate({count}{SELECTOR}{RATE}))"


def _latency_targets(spec: m.MetricSpec, quantiles: tuple[float, ...]) -> tuple[Target, ...]:
    percentiles = tuple(Target(_quantile(q, spec), f"p{round(q * 100)}") for q in quantiles)
    return (*percentiles, Target(_mean(spec), "mean"))


def _by_replica(spec: m.MetricSpec, aggregation: str = "max") -> str:
    return f"{aggregation} by (replica) ({_series(spec)}{SELECTOR})"


def _increase_by(spec: m.MetricSpec, by: str) -> str:
    return f"sum by ({by}) (increase({_series(spec)}{SELECTOR}{RATE}))"


_DISK_READS = '{model_name=~"$model_name", transfer_type="DISK_to_CPU"}'


def _tier_hit_rate(tier: str) -> str:
    """Prompt tokens one KV tier below the device supplied / looked up there."""
    selector = f'{{model_name=~"$model_name", tier="{tier}"}}'
    return (f"sum(rate({_series(m.KV_TIER_HITS)}{selector}{RATE})) / "
            f"(sum(rate({_series(m.KV_TIER_QUERIES)}{selector}{RATE})) > 0)")


LATENCY = Row("Latency", (
    Panel("Time to first token",
          "Arrival to first token, measured in the engine (vLLM semantics).", "s",
          _latency_targets(m.TIME_TO_FIRST_TOKEN, (0.5, 0.95, 0.99))),
    Panel("Inter-token latency",
          "Gap between consecutive tokens of a request, pooled over requests.", "s",
          _latency_targets(m.INTER_TOKEN_LATENCY, (0.5, 0.99))),
    Panel("End-to-end request latency", "Arrival to finish.", "s",
          _latency_targets(m.E2E_REQUEST_LATENCY, (0.5, 0.95, 0.99))),
    Panel("Queue, prefill and decode time (mean)",
          "Where a request's time goes: waiting, prefill, decode.", "s",
          (Target(_mean(m.REQUEST_QUEUE_TIME), "queue"),
           Target(_mean(m.REQUEST_PREFILL_TIME), "prefill"),
           Target(_mean(m.REQUEST_DECODE_TIME), "decode"))),
))

THROUGHPUT = Row("Throughput", (
    Panel("Token throughput", "Prompt (prefill) and generation tokens per second, all replicas.",
          "tokens/s",
          (Target(f"sum(rate({_series(m.PROMPT_TOKENS)}{SELECTOR}{RATE}))", "prompt tokens/s"),
           Target(f"sum(rate({_series(m.GENERATION_TOKENS)}{SELECTOR}{RATE}))",
                  "generation tokens/s"))),
    Panel("Finish reasons", "Finished requests per interval by finish reason.", "short",
          (Target(_increase_by(m.REQUEST_SUCCESS, "finished_reason"), "{{finished_reason}}"),),
          stacked=True),
    Panel("Tokens per engine step",
          "Batch size in tokens: continuous batching keeps this high and steady.", "short",
          (Target(_quantile(0.5, m.ITERATION_TOKENS), "p50"),
           Target(_quantile(0.99, m.ITERATION_TOKENS), "p99"))),
    Panel("Prefix-cache hit rate", "Prompt tokens found in the prefix cache / looked up, per "
          "tier: the device KV, then the host KV tier (kv_offloading_size) for what the device "
          "missed, then the disk tier (kv_offloading_disk_path) for what the host missed too.",
          "percentunit",
          (Target(f"sum(rate({_series(m.PREFIX_CACHE_HITS)}{SELECTOR}{RATE})) / "
                  f"(sum(rate({_series(m.PREFIX_CACHE_QUERIES)}{SELECTOR}{RATE})) > 0)",
                  "device"),
           Target(f"sum(rate({_series(m.EXTERNAL_PREFIX_CACHE_HITS)}{SELECTOR}{RATE})) / "
                  f"(sum(rate({_series(m.EXTERNAL_PREFIX_CACHE_QUERIES)}{SELECTOR}{RATE})) > 0)",
                  "host and disk tiers", requires="host_tier"),
           Target(_tier_hit_rate("disk"), "disk tier", requires="disk_tier")),
          max_value=1.0),
))

SCHEDULER = Row("Scheduler and KV cache", (
    Panel("Running and waiting requests per replica", "The batch and the queue of each replica.",
          "short",
          (Target(_by_replica(m.NUM_REQUESTS_RUNNING), "{{replica}} running"),
           Target(_by_replica(m.NUM_REQUESTS_WAITING), "{{replica}} waiting"))),
    Panel("KV-cache usage per replica",
          "Used / total KV blocks; the dashed line is the router's high watermark.",
          "percentunit", (Target(_by_replica(m.KV_CACHE_USAGE_PERC), "{{replica}}"),),
          max_value=1.0, threshold_line=DEFAULT_KV_WATERMARK),
    Panel("Preemptions and out-of-blocks events",
          "Per interval: requests preempted (recomputed) and steps that ran out of KV blocks.",
          "short",
          (Target(_increase_by(m.NUM_PREEMPTIONS, "replica"), "{{replica}} preemptions"),
           Target(_increase_by(m.NUM_OUT_OF_BLOCKS, "replica"), "{{replica}} out of blocks"))),
    Panel("KV tier copies",
          "Bytes per second copied out to the host tier (GPU_to_CPU: blocks the device evicted) "
          "and back (CPU_to_GPU: prefix hits there), written to the disk tier (CPU_to_DISK: "
          "blocks the host tier evicted) and read back (DISK_to_CPU), all replicas.", "Bps",
          (Target(f"sum by (transfer_type) (rate({_series(m.KV_OFFLOAD_TOTAL_BYTES)}{SELECTOR}"
                  f"{RATE}))", "{{transfer_type}}"),)),
    Panel("Disk KV tier reads and errors",
          "Seconds per GiB read back from the disk tier (its hits' read time), and blocks "
          "computed instead of written or read back per interval, by reason (corrupt, "
          "read_failed, disk_full, write_failed, dropped).", "short",
          (Target(f"sum(rate({_series(m.KV_OFFLOAD_TOTAL_TIME)}{_DISK_READS}{RATE})) / "
                  f"(sum(rate({_series(m.KV_OFFLOAD_TOTAL_BYTES)}{_DISK_READS}{RATE})) > 0) "
                  f"* 2^30", "read s/GiB", requires="disk_tier"),
           Target(_increase_by(m.KV_DISK_ERRORS, "reason"), "{{reason}}",
                  requires="disk_tier"))),
))

_GPU_UTILISATION = (
    Target("avg by (gpu, Hostname) (DCGM_FI_DEV_GPU_UTIL)", "dcgm {{Hostname}} gpu {{gpu}}",
           requires="gpu"),
    Target("100 * avg by (uuid) (nvidia_smi_utilization_gpu_ratio)", "nvidia-smi {{uuid}}",
           requires="gpu"),
    Target("avg by (GpuIndex, instance) (ray_node_gpus_utilization)",
           "ray {{instance}} gpu {{GpuIndex}}", requires="gpu"),
)

FLEET = Row("Fleet: replicas, router, autoscaler, GPUs", (
    Panel("Replicas vs autoscaler target",
          "Replicas reporting engine metrics, and the count the autoscaling policy asked for.",
          "short",
          (Target(f"count(count by (replica) ({_series(m.NUM_REQUESTS_RUNNING)}{SELECTOR}))",
                  "replicas"),
           Target(f"max({_series(m.AUTOSCALER_TARGET_REPLICAS)}{SELECTOR})", "target",
                  requires="autoscaler"))),
    Panel("Router decisions per replica", "Requests per second the router sent to each replica.",
          "reqps",
          (Target(f"sum by (replica) (rate({_series(m.ROUTER_DECISIONS)}{SELECTOR}{RATE}))",
                  "{{replica}}", requires="router"),),
          stacked=True),
    Panel("Replica start-up by stage",
          "Seconds each replica's start spent per stage (imports, config, tokenizer, weights "
          "read and placed, KV cache, graphs, the rest), stacked: what a scale-up waits for.",
          "s",
          (Target(f"max by (replica, stage) ({_series(m.REPLICA_STARTUP_SECONDS)}{SELECTOR})",
                  "{{replica}} {{stage}}"),),
          stacked=True),
    Panel("Replica start-up: bytes written by stage",
          "Bytes each stage wrote into new memory: the parameters once, plus every copy "
          "before them (dequantised or converted weights), and the zeroed KV cache.",
          "bytes",
          (Target(f"max by (replica, stage) "
                  f"({_series(m.REPLICA_STARTUP_BYTES_COPIED)}{SELECTOR})",
                  "{{replica}} {{stage}}"),),
          stacked=True),
    Panel("GPU utilisation", "From an NVML exporter when one is scraped (empty on CPU).",
          "percent", _GPU_UTILISATION, width=24, max_value=100.0),
))

def _by_tenant(spec: m.MetricSpec, extra: str = "") -> str:
    return f"sum by (tenant{extra}) (rate({_series(spec)}{SELECTOR}{RATE}))"


TENANTS = Row("Tenants (the first 32 seen by each ingress; the rest as \"other\")", (
    Panel("Requests per tenant", "Requests per second each tenant sent: admitted, and refused "
          "by its quota (429 rate_limit_exceeded).", "reqps",
          (Target(_by_tenant(m.TENANT_REQUESTS, ", outcome"), "{{tenant}} {{outcome}}",
                  requires="tenants"),), stacked=True),
    Panel("Tokens per tenant", "Prompt and generated tokens per second of each tenant's "
          "requests (what its tokens-per-minute quota counts, / 60).", "tokens/s",
          (Target(_by_tenant(m.TENANT_PROMPT_TOKENS), "{{tenant}} prompt", requires="tenants"),
           Target(_by_tenant(m.TENANT_GENERATION_TOKENS), "{{tenant}} generated",
                  requires="tenants")), stacked=True),
    Panel("Time to first token per tenant (p95)", "As the ingress sees it: from admission "
          "(quota granted) to the first token; compare with a tenant's ttft_slo_ms.", "s",
          (Target(_quantile(0.95, m.TENANT_TIME_TO_FIRST_TOKEN, by="le, tenant"),
                  "{{tenant}} p95", requires="tenants"),), width=24),
))

ROWS: tuple[Row, ...] = (LATENCY, THROUGHPUT, SCHEDULER, FLEET, TENANTS)

