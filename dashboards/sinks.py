"""Where metric values go: prometheus_client (one host) or Ray's metrics agent (a cluster).

Replicas run in their own Ray worker processes while the ingress answers GET /metrics, so a
plain in-process registry would only ever show the ingress's own numbers. Two real paths:

* ``prometheus`` (the default, for the embedded single-node server): prometheus_client in
  multiprocess mode. The launcher calls `prepare_multiprocess_dir` *before* `ray.init`, so every
  Ray worker inherits ``PROMETHEUS_MULTIPROC_DIR``; each process writes its values to mmap files
  there and the ingress merges them at scrape time (`metrics_text`). Without the variable the
  same code uses an ordinary in-process registry (tests, a single process).
* ``ray`` (a multi-node cluster): `ray.util.metrics` instruments, exported by the metrics agent
  on every node and discovered by Prometheus through Ray's service-discovery file. Ray 2.60
  deprecates ':' in names and prefixes ``ray_``, so ``iterserve:x`` is exported as
  ``ray_iterserve_x``; the cluster scrape config renames it back (see `prometheus_config`).

Pick the backend with ``ITERSERVE_METRICS_BACKEND`` (``prometheus`` | ``ray``) or pass it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, multiprocess, values

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
BACKEND_ENV = "ITERSERVE_METRICS_BACKEND"
BACKENDS = ("prometheus", "ray")
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

MetricKind = Literal["counter", "gauge", "histogram"]

DEFAULT_PREFIX = "iterserve:"
# With this prefix every metric vLLM also has carries vLLM's exact name and label set
# (model_name, engine); iterserve's own metrics keep DEFAULT_PREFIX, so no name is invented
# under vLLM's namespace.
VLLM_PREFIX = "vllm:"
LABEL_REPLICA = "replica"
VLLM_ENGINE_LABEL = "engine"
VLLM_ENGINE_INDEX = "0"  # one engine per replica: vLLM's label value for a single engine


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name without prefix (counters without ``_total``), type, labels."""

    key: str
    kind: MetricKind
    documentation: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    # How a gauge is merged across processes in multiprocess mode. The replica label makes
    # series unique per process; "live" drops a process's values once it is marked dead.
    multiprocess_mode: str = "livemostrecent"
    # The name without prefix in vLLM (vllm/v1/metrics/loggers.py); None: vLLM has none.
    vllm_key: str | None = None

    def name(self, prefix: str) -> str:
        """The name given to the client library, e.g. ``iterserve:prompt_tokens``."""
        if prefix == VLLM_PREFIX:
            return f"{VLLM_PREFIX}{self.vllm_key}" if self.vllm_key else (
                f"{DEFAULT_PREFIX}{self.key}")
        return f"{prefix}{self.key}"

    def exposed_name(self, prefix: str) -> str:
        """The series name Prometheus stores (counters gain ``_total``)."""
        suffix = "_total" if self.kind == "counter" else ""
        return self.name(prefix) + suffix

    def label_names(self, prefix: str) -> tuple[str, ...]:
        """Under vLLM's names an engine metric also carries vLLM's ``engine`` label."""
        if prefix == VLLM_PREFIX and self.vllm_key and LABEL_REPLICA in self.labels:
            return (*self.labels, VLLM_ENGINE_LABEL)
        return self.labels

    def select_labels(self, prefix: str, labels: dict[str, str]) -> dict[str, str]:
        """The values of this metric's labels (callers may pass more, e.g. ``engine``)."""
        return {name: labels[name] for name in self.label_names(prefix)}


class MetricSink(Protocol):
    """Receives values for the metrics in a catalogue; one instance per process and prefix."""

    def counter_inc(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None: ...

    def gauge_set(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None: ...

    def histogram_observe(
        self, spec: MetricSpec, value: float, labels: dict[str, str]
    ) -> None: ...


def multiprocess_enabled() -> bool:
    return bool(os.environ.get(MULTIPROC_DIR_ENV))


def prepare_multiprocess_dir(directory: str | os.PathLike[str]) -> Path:
    """Wipe and create the shared metrics folder and point this process (and children) at it.

    Call it in the launcher before `ray.init` (workers inherit the environment). If
    prometheus_client was imported earlier in this process, its value class is switched so
    metrics created from now on are file-backed too.
    """
    path = Path(directory)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.environ[MULTIPROC_DIR_ENV] = str(path)
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()
    return path


def mark_this_process_dead() -> None:
    """Drop this process's live gauges from the shared folder (call when a replica stops)."""
    if multiprocess_enabled():
        multiprocess.mark_process_dead(os.getpid())


class _NameFilter:
    """A collector that yields only the families of `source` whose names start with a prefix."""

    def __init__(self, source: Any, prefixes: tuple[str, ...]) -> None:
        self._source = source
        self._prefixes = prefixes

    def collect(self) -> Any:
        for family in self._source.collect():
            if family.name.startswith(self._prefixes):
                yield family


def metrics_text(registry: CollectorRegistry | None = None,
                 name_prefixes: tuple[str, ...] = ()) -> bytes:
    """The Prometheus text exposition for GET /metrics.

    In multiprocess mode every process's values are merged from the shared folder, keeping
    only families named with `name_prefixes` when given: Ray's own processes (dashboard,
    autoscaler) inherit the folder too, and their metrics belong to Ray's exporter. Otherwise
    `registry` (default: the global one) is rendered as is.
    """
    if multiprocess_enabled() and registry is None:
        merged = CollectorRegistry(auto_describe=False)
        collector = multiprocess.MultiProcessCollector(None)
        merged.register(_NameFilter(collector, name_prefixes) if name_prefixes else collector)
        return prometheus_client.generate_latest(merged)
    return prometheus_client.generate_latest(registry or prometheus_client.REGISTRY)


class _InstrumentCache:
    """One instrument per metric, created on first use (`_create`) and kept."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._instruments: dict[str, Any] = {}

    def _instrument(self, spec: MetricSpec) -> Any:
        instrument = self._instruments.get(spec.key)
        if instrument is None:
            instrument = self._instruments[spec.key] = self._create(spec)
        return instrument

    def _create(self, spec: MetricSpec) -> Any:
        raise NotImplementedError


class PrometheusClientSink(_InstrumentCache):
    """prometheus_client instruments, created on first use and shared per registry."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        super().__init__(prefix)
        self._registry = registry

    def _create(self, spec: MetricSpec) -> Any:
        name = spec.name(self._prefix)
        common: dict[str, Any] = {"labelnames": spec.label_names(self._prefix),
                                  "registry": self._registry}
        if spec.kind == "counter":
            return prometheus_client.Counter(name, spec.documentation, **common)
        if spec.kind == "gauge":
            return prometheus_client.Gauge(
                name, spec.documentation, multiprocess_mode=spec.multiprocess_mode, **common
            )
        return prometheus_client.Histogram(
            name, spec.documentation, buckets=spec.buckets, **common
        )

    def _child(self, spec: MetricSpec, labels: dict[str, str]) -> Any:
        return self._instrument(spec).labels(**spec.select_labels(self._prefix, labels))

    def counter_inc(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._child(spec, labels).inc(value)

    def gauge_set(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._child(spec, labels).set(value)

    def histogram_observe(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._child(spec, labels).observe(value)


class RayMetricsSink(_InstrumentCache):
    """`ray.util.metrics` instruments (exported by each node's Ray metrics agent)."""

    def _create(self, spec: MetricSpec) -> Any:
        from ray.util import metrics as ray_metrics

        # Ray 2.60 warns on ':' and will reject it; the scrape config restores the prefix.
        name = spec.name(self._prefix).replace(":", "_")
        tag_keys = spec.label_names(self._prefix)
        if spec.kind == "counter":
            return ray_metrics.Counter(name, spec.documentation, tag_keys=tag_keys)
        if spec.kind == "gauge":
            return ray_metrics.Gauge(name, spec.documentation, tag_keys=tag_keys)
        return ray_metrics.Histogram(
            name, spec.documentation, boundaries=list(spec.buckets), tag_keys=tag_keys
        )

    def counter_inc(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        if value > 0:  # Ray counters reject 0 increments
            self._instrument(spec).inc(value, tags=spec.select_labels(self._prefix, labels))

    def gauge_set(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._instrument(spec).set(value, tags=spec.select_labels(self._prefix, labels))

    def histogram_observe(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._instrument(spec).observe(value, tags=spec.select_labels(self._prefix, labels))


_SINKS: dict[tuple[str, int, str], MetricSink] = {}


def resolve_backend(backend: str | None) -> str:
    chosen = backend or os.environ.get(BACKEND_ENV) or "prometheus"
    if chosen not in BACKENDS:
        raise ValueError(f"unknown metrics backend {chosen!r}; choose one of {BACKENDS}")
    return chosen


def get_sink(
    prefix: str, registry: CollectorRegistry | None = None, backend: str | None = None
) -> MetricSink:
    """The process-wide sink for (backend, registry, prefix): instruments are created once."""
    chosen = resolve_backend(backend)
    target = registry if registry is not None else prometheus_client.REGISTRY
    key = (chosen, id(target) if chosen == "prometheus" else 0, prefix)
    sink = _SINKS.get(key)
    if sink is None:
        sink = PrometheusClientSink(target, prefix) if chosen == "prometheus" else (
            RayMetricsSink(prefix)
        )
        _SINKS[key] = sink
    return sink
