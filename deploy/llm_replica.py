"""LLMReplica: the Serve deployment that owns one AsyncLLMEngine (one GPU, or CPU).

`generate` is an async generator: when the caller goes away Serve injects CancelledError into
it (Ray Serve 2.60 `_call_generator_async` -> `gen.athrow`), and `stream_engine` closes the
engine's generator and aborts the request so its KV blocks are freed. Engine errors raised
before the first output are yielded as `EngineErrorInfo` records rather than raised, so they
cross the handle intact (no RayTaskError wrapping).

`record_routing_stats` / `record_autoscaling_stats` return the replica's `ReplicaLoad`
(autoscale/signals.py), the one wire type of its load; the routing stats also carry the
stable hashes of the blocks its prefix cache can hit (replica/block_hashes.py), so that
KVAwareRouter knows which replica holds a prompt's prefix. Only that call pays for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.exceptions import RayServeException

from iterserve.autoscale.router import ROUTE_TO_KWARG
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.deploy.engine_info import describe_engine, lora_adapter_action, stream_engine
from iterserve.deploy.errors import EngineErrorInfo
from iterserve.deploy.kv_pull import (
    ExportTimes,
    KVPullConfig,
    KVPuller,
    PullHint,
    export_chunks,
)
from iterserve.deploy.lora_registry import RayAdapterRegistry, registry_actor_name
from iterserve.replica.block_keys import CacheNamespace, with_adapter
from iterserve.replica.config import EngineConfig
from iterserve.replica.errors import EngineDeadError
from iterserve.replica.lora_adapter import LoRARequest
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.request import TenantShare
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.startup import StartupRecorder

logger = logging.getLogger(__name__)

__all__ = ["LLMReplica", "replica_actor_options"]

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# The slowest per-stream decode a loaded replica is expected to run (20 tokens/s): a drain
# that lets a max_model_len generation finish at this pace drops no stream.
DRAIN_SECONDS_PER_TOKEN = 0.05
SHUTDOWN_SLACK_S = 5.0  # Serve's timeout beyond the drain: the engine's own shutdown
# How long record_routing_stats waits for the engine thread's prefix-cache report (taken
# between steps) before sending the previous one: well inside Serve's routing-stats timeout.
CACHE_REPORT_WAIT_S = 0.5


def drain_timeout_for(max_model_len: int) -> float:
    """A drain covering the longest allowed generation. Serve's graceful_shutdown_timeout_s
    (default 20 s) would cut a long stream short on every scale-down and redeploy."""
    return max(DEFAULT_DRAIN_TIMEOUT_S, max_model_len * DRAIN_SECONDS_PER_TOKEN)


def replica_actor_options(num_gpus: float | None = None, num_cpus: float | None = None
                          ) -> dict[str, float]:
    """One GPU per replica where the cluster has GPUs, else a share of the CPUs."""
    if num_gpus is None:
        num_gpus = 1.0 if _cluster_has_gpus() else 0.0
    options: dict[str, float] = {"num_gpus": float(num_gpus)}
    options["num_cpus"] = float(num_cpus if num_cpus is not None else (1.0 if num_gpus else 0.5))
    return options


def _cluster_has_gpus() -> bool:
    """GPUs in the connected Ray cluster; before ray.init (`serve run mod:app`), this host's."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def _device_idle_report(engine: Any) -> dict[str, dict[str, float]] | None:
    meter = getattr(engine.runner, "device_idle", None)
    return None if meter is None else meter.report()


def replica_engine_kwargs(engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The replica's engine settings: cpu_threads defaults to every core but one, so the
    engine's matmuls leave a core to this node's HTTP proxy and ingress."""
    from iterserve.replica.config import replica_cpu_threads

    return {"cpu_threads": replica_cpu_threads(), **(engine_kwargs or {})}


def _install_stat_logger(engine: Any, replica_id: str, metrics_prefix: str | None) -> Any | None:
    """The engine's Prometheus stat logger (`iterserve.dashboards.metrics`)."""
    # Imported in the replica's process, after its metrics environment is set.
    from iterserve.dashboards.metrics import DEFAULT_PREFIX, PrometheusStatLogger

    stat_logger = PrometheusStatLogger(engine.model_name, replica_id=replica_id,
                                       prefix=metrics_prefix or DEFAULT_PREFIX)
    engine.add_stat_logger(stat_logger)
    return stat_logger


@serve.deployment(
    name="LLMReplica",
    max_ongoing_requests=256,
    graceful_shutdown_wait_loop_s=1.0,
    graceful_shutdown_timeout_s=DEFAULT_DRAIN_TIMEOUT_S + 5,
    # A dead engine loop fails the next check: replaced within seconds, not tens of seconds.
    health_check_period_s=2,
)
class LLMReplica:
    """One engine per replica; streams RequestOutput deltas to the ingress."""

    async def __init__(self, engine_config: EngineConfig,
                       drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                       metrics_prefix: str | None = None,
                       kv_pull: KVPullConfig | None = None) -> None:
        """engine_config: resolved once by the deployment (deploy/settings.py); kv_pull:
        whether and how this replica pulls cached prefixes from its peers (default: off)."""
        started = time.monotonic()
        startup = StartupRecorder()
        # This module (torch with it) was imported when Ray unpickled the class: in a pooled
        # worker often long before this replica was asked for, else within actor_start.
        with startup.stage("imports"):
            from iterserve.replica import AsyncLLMEngine

        self.engine = AsyncLLMEngine(engine_config)
        with startup.stage("engine_start"):
            self._replica_id = self._current_replica_id()
            self._stat_logger = _install_stat_logger(self.engine, self._replica_id,
                                                     metrics_prefix)
        startup.merge(self.engine.startup)
        ready = time.monotonic()
        # Its start-up by stage (replica/startup.py), with when this constructor began and
        # ended on this node's monotonic clock, so whoever asked for the replica can add what
        # came before (the actor's start) and after (its first token).
        self._startup = {"stages": startup.as_dict(), "started_at": started, "ready_at": ready}
        if self._stat_logger is not None:
            self._stat_logger.record_startup(self._startup["stages"])
        self._drain_timeout_s = drain_timeout_s
        self._num_requests = 0
        self._num_cancelled = 0  # streams closed before their end (disconnects)
        self._cache_report: dict[str, list[int]] | None = None  # the last per-tier block hashes
        self._closed = False
        self._peers: Any = None  # a handle to this deployment, made at the first pull
        self._adapters: RayAdapterRegistry | None = None  # the app's registry, at first use
        self._puller = KVPuller(self.engine, kv_pull or KVPullConfig(), self._replica_id,
                                self._export_from, self._record_pull)
        self._exported = ExportTimes()  # the pulls peers made from this replica
        logger.info("LLMReplica %s serving %s", self._replica_id, self.engine.model_name)

    @staticmethod
    def _current_replica_id() -> str:
        try:
            return serve.get_replica_context().replica_id.unique_id
        except (RuntimeError, RayServeException):  # outside Serve (local testing)
            return f"pid-{os.getpid()}"

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, cache_namespace: CacheNamespace = b"",
                       lora_request: LoRARequest | None = None, tenant: TenantShare | None = None,
                       kv_pull_hint: tuple[str, int] | None = None,
                       route_to_replica: str | None = None,
                       ) -> AsyncIterator[RequestOutput | EngineErrorInfo]:
        """Stream one request's deltas; early close (disconnect) aborts it. cache_namespace:
        the prefix-cache namespace its blocks live in (its tenant's; replica/block_keys.py).
        kv_pull_hint: the router's (replica id, cached tokens) of the replica holding the
        longest prefix of the prompt, pulled from first when that pays (deploy/kv_pull.py).
        route_to_replica: the replica the caller placed it on (the router's business)."""
        self._num_requests += 1
        if params.prompt_logprobs is None:  # else every prompt position is computed anyway
            await self._puller.pull(
                prompt_token_ids,
                with_adapter(cache_namespace, lora_request.name if lora_request else None),
                PullHint.parse(kv_pull_hint))
        stream = stream_engine(self.engine, prompt_token_ids, params, request_id, priority,
                               cache_namespace, lora_request, tenant, self._adapter_still_loaded)
        complete = False
        try:
            async for item in stream:
                yield item
            complete = True
        finally:
            if not complete:
                self._num_cancelled += 1
            await stream.aclose()

    async def export_kv_blocks(self, prefix_token_ids: list[int],
                               cache_namespace: CacheNamespace, first_block: int,
                               max_bytes: int, route_to_replica: str | None = None,
                               ) -> list[Any]:
        """A peer pulls the prompt's cached blocks from first_block on (at most max_bytes):
        object refs of KVBlockPayload chunks, copied between this engine's steps.
        route_to_replica: this replica's id, which made the router pick it (checked)."""
        if route_to_replica not in (None, self._replica_id):
            return []  # reached another replica than named: its blocks are not the hint's
        return await export_chunks(self.engine, prefix_token_ids, cache_namespace,
                                   first_block, max_bytes, self._exported)

    async def _export_from(self, holder: str, token_ids: list[int],
                           namespace: CacheNamespace, first_block: int,
                           max_bytes: int) -> list[Any]:
        """Call export_kv_blocks on the replica `holder` through this deployment's handle
        (the router ranks only the replica that route_to_replica names)."""
        if self._peers is None:
            context = serve.get_replica_context()
            self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
        return await self._peers.export_kv_blocks.remote(
            token_ids, namespace, first_block, max_bytes, **{ROUTE_TO_KWARG: holder})

    async def _adapter_still_loaded(self, lora: LoRARequest) -> bool:
        """Asked before this replica reads a runtime-loaded adapter back: whether the
        version the request was admitted with is still loaded (deploy/lora_registry.py)."""
        if self._adapters is None:
            self._adapters = RayAdapterRegistry(
                registry_actor_name(serve.get_replica_context().app_name))
        return await self._adapters.is_current(lora.name, lora.version)

    def _record_pull(self, outcome: str, nbytes: int) -> None:
        if self._stat_logger is not None:
            self._stat_logger.record_kv_pull(outcome, nbytes)

    async def lora_adapter(self, action: str, name: str, path: str | None = None
                           ) -> EngineErrorInfo | None:
        """Load ("load", from `path`) or unload ("unload") an adapter here (the ingress
        broadcasts it); an engine error comes back as data, None when done."""
        return await lora_adapter_action(self.engine, action, name, path)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def check_health(self) -> None:
        """Serve's health check (every health_check_period_s): a dead engine loop fails it,
        so Serve replaces this replica instead of leaving it answering 500s forever."""
        if not self.engine.is_healthy:
            raise RuntimeError("the engine loop is not running")

    def info(self, route_to_replica: str | None = None) -> dict[str, Any]:
        """Model, resolved engine config and live stats (the ingress and tests read it);
        route_to_replica: the replica the caller asked (the router's business)."""
        extra = {"replica_id": self._replica_id, "num_requests": self._num_requests,
                 "num_cancelled": self._num_cancelled, "startup": self._startup,
                 "kv_pulls": dict(self._puller.outcomes),
                 "kv_pulled": {"bytes": self._puller.bytes_received,
                               "tokens": self._puller.tokens_received,
                               "seconds": dict(self._puller.phase_seconds)},
                 "kv_exported": {"calls": self._exported.calls,
                                 "seconds": dict(self._exported.seconds)}}
        return describe_engine(self.engine, extra)

    async def device_idle(self) -> dict[str, dict[str, float]] | None:
        """The simulated runner's `DeviceIdleMeter` report (None for a real runner), read on
        the engine thread: the engine CPU time per step its simulated GPU waited for."""
        return await self.engine.call(_device_idle_report)

    async def record_routing_stats(self) -> dict[str, float | dict[str, bytes] | list[str]]:
        """Polled by the Serve controller for the request router (KVAwareRouter)."""
        load = self._load()
        try:
            self._cache_report = await asyncio.wait_for(self.engine.cached_block_hashes(),
                                                        CACHE_REPORT_WAIT_S)
        except asyncio.TimeoutError:  # a long step: the last report is one period older
            logger.debug("prefix-cache report not ready in %.1f s", CACHE_REPORT_WAIT_S)
        except EngineDeadError:  # the load says it admits nothing; no cache to report
            self._cache_report = None
        return load.with_cached_blocks(
            self._cache_report, self.engine.config.cache.block_size).to_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Sampled by Serve for the autoscaling policy (KVAutoscalingPolicy)."""
        return self._load().to_autoscaling_metrics()

    def _load(self) -> ReplicaLoad:
        load = ReplicaLoad.from_engine_stats(self.engine.stats(), self._admits_nothing)
        # The resident adapters, not every registered one: a load reaches every replica, and
        # a router told that all replicas hold all adapters has no affinity to follow.
        return load.with_adapters(self.engine.resident_loras())

    @property
    def _admits_nothing(self) -> bool:
        """Draining, or its engine loop died: routers rank it last until Serve replaces it."""
        return self.engine.is_draining or not self.engine.is_healthy

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop admitting new requests and wait for the in-flight ones."""
        await self.engine.drain(self._drain_timeout_s if timeout_s is None else timeout_s)

    async def end_streams(self, message: str) -> int:
        """End every request now with a 503 carrying `message` (`iterserve serve`'s drain ran
        out of time): its client gets an error it can read, not a cut connection."""
        return await self.engine.end_requests(message)

    async def __del__(self) -> None:
        """Serve's graceful shutdown: stop admitting, drain, then free the engine."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self.engine.drain(self._drain_timeout_s),
                                   self._drain_timeout_s + 1)
        except (asyncio.TimeoutError, RuntimeError) as error:
            logger.warning("drain did not finish cleanly: %s", error)
        finally:
            self.engine.shutdown()
            if self._stat_logger is not None:
                self._stat_logger.close()
