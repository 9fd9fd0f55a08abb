"""The load harness the simulated-cluster experiments and Ray tests share.

A request's record as the driver saw it (`ClientRecord`), `drive` (send `WorkloadRequest`s
through a DeploymentHandle at their arrival times and time every stream),
`ReplicaStatsPoller` (sample every replica's load signals), `start_ray` and `replica_app`
(deploy's LLMReplica with a chosen router and autoscaling).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.sim.workload import WorkloadRequest

REPLICA_DEPLOYMENT = "LLMReplica"
# The simulated GPU runs in slow motion (time_scale) so that 4-8 replicas' token streams fit
# in 2 CPU cores; every arm of an experiment uses the same factor, so comparisons are fair.
DEFAULT_TIME_SCALE = 5.0


# ------------------------------------------------------------------------------ driving
@dataclass
class ClientRecord:
    """One request as the driver saw it, plus the engine's own timestamps of it.

    Every time is time.monotonic(): CLOCK_MONOTONIC is one clock for every process on the
    machine, so the replica's engine times (RequestOutput.arrival_time, .first_token_time)
    and the driver's line up, and the Ray path's own latency splits into dispatch (handle
    call -> the replica calls its engine) and return (the engine emits the first token ->
    the driver receives it) around the engine's TTFT, which is what the simulator models.
    """

    request_id: str
    sent: float
    kind: str  # the request's WorkloadRequest.kind ("long", "short", ...)
    prompt_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    engine_arrival: float | None = None  # when the replica called its engine
    engine_first_token: float | None = None  # when the engine sampled its first token
    cached_tokens: int = 0  # prompt tokens the replica's prefix cache served

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def dispatch_latency(self) -> float | None:
        """Handle call to the replica calling its engine: routing, the actor call."""
        return None if self.engine_arrival is None else self.engine_arrival - self.sent

    @property
    def engine_ttft(self) -> float | None:
        """Engine call to first sampled token (what the cluster simulator models)."""
        if self.engine_arrival is None or self.engine_first_token is None:
            return None
        return self.engine_first_token - self.engine_arrival

    @property
    def return_latency(self) -> float | None:
        """First token sampled in the engine to first token received by the driver."""
        if self.first_token is None or self.engine_first_token is None:
            return None
        return self.first_token - self.engine_first_token

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")


REQUEST_TIMEOUT_S = 300.0  # a request still streaming after this counts as failed


def request_seed(request_id: str) -> int:
    """The sampling seed the driver gives a request: its tokens follow from it alone
    (`sim_runner.sim_output_tokens`), so a replayed chat can hold the answer it got."""
    return zlib.crc32(request_id.encode())


async def _one(handle: Any, spec: WorkloadRequest, t0: float) -> ClientRecord:  # noqa: ANN401
    delay = t0 + spec.arrival_time - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    rec = ClientRecord(spec.request_id, time.monotonic(), spec.kind,
                        prompt_tokens=len(spec.prompt_token_ids))
    try:
        await asyncio.wait_for(_stream_into(handle, spec, rec), REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        rec.error = f"timeout after {REQUEST_TIMEOUT_S:.0f}s"
    rec.finished = time.monotonic()
    return rec


async def _stream_into(handle: Any, spec: WorkloadRequest, rec: ClientRecord) -> None:  # noqa: ANN401
    from iterserve.replica.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=spec.max_tokens, seed=request_seed(spec.request_id),
                            ignore_eos=True)
    last = None
    try:
        stream = handle.options(stream=True).generate.remote(
            spec.prompt_token_ids, params, spec.request_id
        )
        async for out in stream:
            now = time.monotonic()
            new = getattr(out, "new_token_ids", None)
            if new is None:  # deploy's EngineErrorInfo record
                rec.error = repr(out)
                break
            if rec.first_token is None:
                rec.first_token = now
                rec.engine_arrival = getattr(out, "arrival_time", None) or None
                rec.engine_first_token = getattr(out, "first_token_time", None)
            elif last is not None:
                rec.gaps.append(now - last)
            last = now
            rec.num_tokens += len(new)
            if out.finished:
                rec.finish_reason = out.finish_reason
                rec.cached_tokens = getattr(out, "num_cached_tokens", 0)
    except Exception as error:  # noqa: BLE001 - recorded as a failed request, reported
        rec.error = f"{type(error).__name__}: {error}"


async def drive(handle: Any, specs: Sequence[WorkloadRequest]) -> tuple[float, list[ClientRecord]]:  # noqa: ANN401
    """Send every spec at its time; returns (t0 on the monotonic clock, records)."""
    t0 = time.monotonic() + 0.5
    tasks = [asyncio.ensure_future(_one(handle, s, t0)) for s in specs]
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=15.0)
        print(f"  {time.monotonic() - t0:6.1f}s: {len(specs) - len(pending)}/{len(specs)} "
              "requests done", flush=True)
    return t0, [t.result() for t in tasks]


class ReplicaStatsPoller:
    """Polls every replica actor's record_routing_stats (what the controller calls)."""

    def __init__(self, app_name: str, deployment: str = REPLICA_DEPLOYMENT,
                 period_s: float = 0.5) -> None:
        self.prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
        self.period_s = period_s
        self.samples: list[dict[str, Any]] = []  # t (monotonic), replica, stats...
        self.counts: list[dict[str, Any]] = []  # t, running, starting, stopping
        self.app_name = app_name
        self.deployment = deployment
        self._task: asyncio.Task | None = None

    def _actors(self) -> list[str]:
        import ray

        names = ray.util.list_named_actors(all_namespaces=True)
        return [n["name"] for n in names if n["name"].startswith(self.prefix)]

    def poll_once(self) -> None:
        """One synchronous poll (RPCs with timeouts); run it in a thread from async code."""
        import ray
        from ray import serve

        now = time.monotonic()
        names = self._actors()
        refs = []
        for name in names:
            try:
                refs.append((name, ray.get_actor(name, namespace="serve")
                             .record_routing_stats.remote()))
            except ValueError:
                continue  # stopped between listing and calling
        for name, ref in refs:
            try:
                stats = ray.get(ref, timeout=2.0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
                continue  # starting, stopping or too busy: skip this sample
            if stats:
                # A sample keeps the count of the prefix-cache hashes, not the hashes: a run
                # takes thousands of samples and each may list tens of thousands of blocks.
                tiers = stats.pop("cached_blocks", None)
                if tiers is not None:  # 8 bytes a hash (signals.pack_hashes)
                    stats["num_cached_block_hashes"] = sum(len(b) for b in tiers.values()) // 8
                self.samples.append({"t": now, "replica": name[len(self.prefix):], **stats})
        status = serve.status().applications.get(self.app_name)
        if status is not None and self.deployment in status.deployments:
            states = status.deployments[self.deployment].replica_states
            self.counts.append({"t": now, **{str(k.value if hasattr(k, "value") else k): v
                                             for k, v in states.items()}})

    async def _poll_once(self) -> None:
        await asyncio.to_thread(self.poll_once)

    async def _loop(self) -> None:
        while True:
            await self._poll_once()
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=5.0)


async def device_idle_reports(handle: Any) -> list[dict[str, dict[str, float]]]:  # noqa: ANN401
    """Every replica's `LLMReplica.device_idle()` (the simulated runner's wait for the
    engine's CPU per step), through the handle's broadcast; real runners and replicas that
    fail to answer are left out."""
    results = await handle.broadcast("device_idle").results_async(return_exceptions=True)
    return [r for r in results if isinstance(r, dict)]


def start_ray(env: dict[str, str] | None = None, num_cpus: int = 16) -> None:
    """A local Ray + Serve (no dashboard, no HTTP proxy); env exported before ray.init."""
    import ray
    from ray import serve

    from iterserve.loadtests.servers import interrupt_on_termination

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for key, value in (env or {}).items():
        os.environ[key] = value
    # address="local": always a fresh cluster, never someone else's on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 1024**2)
    interrupt_on_termination()  # a SIGTERM still shuts this cluster down (servers.py)
    serve.start(http_options={"host": "127.0.0.1", "port": 0}, proxy_location="Disabled")


def replica_app(engine_kwargs: dict[str, Any], num_replicas: int | None = None,
                router: Any = None, autoscaling: dict[str, Any] | None = None,  # noqa: ANN401
                drain_timeout_s: float = 60.0, max_ongoing_requests: int = 512
                ) -> Any:  # noqa: ANN401
    """deploy's LLMReplica, bound with the given router / autoscaling options."""
    from iterserve.deploy.llm_replica import LLMReplica
    from iterserve.replica.config import EngineConfig

    options: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing_requests,
        "ray_actor_options": {"num_cpus": 0},
        "graceful_shutdown_timeout_s": drain_timeout_s + 5,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = num_replicas or 1
    if router is not None:
        options["request_router_config"] = router
    return LLMReplica.options(**options).bind(EngineConfig.from_kwargs(**engine_kwargs),
                                              drain_timeout_s)


def quantiles(values: Sequence[float], prefix: str) -> dict[str, float]:
    """{prefix_p10_s, _p50_s, _p90_s, _p99_s}: the figures the Ray path's reports print."""
    return {f"{prefix}_p{q}_s": percentile(values, q) for q in (10, 50, 90, 99)}


def hop_summary(records: Sequence[ClientRecord]) -> dict[str, float]:
    """p10/p50/p90/p99 of dispatch, engine TTFT and return latency over the records that
    carry the engine's timestamps; prefix hit rate (cached / prompt tokens)."""
    ok = [r for r in records if r.ok]
    dispatch = [r.dispatch_latency for r in ok if r.dispatch_latency is not None]
    engine = [r.engine_ttft for r in ok if r.engine_ttft is not None]
    back = [r.return_latency for r in ok if r.return_latency is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {**quantiles(dispatch, "dispatch"), **quantiles(engine, "engine_ttft"),
            **quantiles(back, "return"), "hops_measured": float(len(dispatch)),
            "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan}
