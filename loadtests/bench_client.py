"""The benchmark's client side: closed-loop streaming requests and server-side sampling.

`run_level` keeps `concurrency` requests in flight (each worker sends its next request as
soon as the previous one ends) until the level's requests are done; each stream is timed with
`StreamTiming`. `MetricsSampler` polls the server's GET /metrics meanwhile (KV usage,
running/waiting, out-of-blocks, preemptions) and, when pynvml finds a GPU, NVML utilisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.dashboards import metrics as m
from iterserve.loadtests.streaming import StreamTiming, completion_body

REQUEST_TIMEOUT_S = 900.0


@dataclass
class RequestResult:
    index: int
    prompt_tokens: int
    max_tokens: int
    timing: StreamTiming
    status: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.timing.ok and (
            self.timing.output_tokens == self.max_tokens)


@dataclass
class LevelRun:
    """One level; times are time.perf_counter(), the clock StreamTiming uses too."""

    concurrency: int
    started_at: float
    finished_at: float
    results: list[RequestResult]
    last_dispatch_at: float  # the last request was sent: from here on, fewer than c in flight


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _one_request(session: aiohttp.ClientSession, url: str, model: str, index: int,
                       request: WorkloadRequest) -> RequestResult:
    start = time.perf_counter()
    timing = StreamTiming(start=start)
    result = RequestResult(index, len(request.prompt_token_ids), request.max_tokens, timing)
    try:
        async with session.post(f"{url}/v1/completions",
                                json=completion_body(request, model)) as response:
            result.status = response.status
            if response.status != 200:
                timing.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for data in response.content.iter_any():
                timing.feed_bytes(data, time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        timing.error = f"{type(error).__name__}: {error}"
    return result


async def run_level(url: str, model: str, requests: Sequence[WorkloadRequest], concurrency: int,
                    api_key: str | None = None,
                    on_done: Callable[[RequestResult], None] | None = None) -> LevelRun:
    """Send `requests` with `concurrency` in flight (closed loop); return every result."""
    queue: asyncio.Queue[tuple[int, WorkloadRequest]] = asyncio.Queue()
    for index, request in enumerate(requests):
        queue.put_nowait((index, request))
    results: list[RequestResult] = []
    last_dispatch_at = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal last_dispatch_at
        while not queue.empty():
            index, request = queue.get_nowait()
            if queue.empty():
                last_dispatch_at = time.perf_counter()
            result = await _one_request(session, url, model, index, request)
            results.append(result)
            if on_done is not None:
                on_done(result)

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     headers=_headers(api_key)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return LevelRun(concurrency, started, time.perf_counter(),
                    sorted(results, key=lambda r: r.index), last_dispatch_at)


@dataclass(frozen=True)
class ServerSample:
    t: float  # time.perf_counter()
    kv_usage: float  # max over replicas
    running: float
    waiting: float
    out_of_blocks: float  # cumulative, summed over replicas
    preemptions: float
    gpu_utilisation: float | None = None


_SAMPLED = {
    m.metric_name(m.KV_CACHE_USAGE_PERC): "kv_usage",
    m.metric_name(m.NUM_REQUESTS_RUNNING): "running",
    m.metric_name(m.NUM_REQUESTS_WAITING): "waiting",
    m.metric_name(m.NUM_OUT_OF_BLOCKS): "out_of_blocks",
    m.metric_name(m.NUM_PREEMPTIONS): "preemptions",
}


def parse_server_sample(text: str, t: float) -> ServerSample:
    """Reduce one /metrics scrape to the values the benchmark tracks."""
    values: dict[str, list[float]] = {field_name: [] for field_name in _SAMPLED.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field_name = _SAMPLED.get(sample.name)
            if field_name is not None:
                values[field_name].append(sample.value)
    return ServerSample(t=t, kv_usage=max(values["kv_usage"], default=0.0),
                        running=sum(values["running"]), waiting=sum(values["waiting"]),
                        out_of_blocks=sum(values["out_of_blocks"]),
                        preemptions=sum(values["preemptions"]))


class NvmlSampler:
    """GPU utilisation through pynvml, when installed and a GPU is present."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError:
            return
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def utilisation(self) -> float | None:
        if not self._handles:
            return None
        rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
        return sum(rates) / len(rates)


@dataclass
class MetricsSampler:
    """Polls GET /metrics every `interval_s` while running (start/stop around a mode)."""

    url: str
    interval_s: float = 0.5
    samples: list[ServerSample] = field(default_factory=list)
    errors: int = 0
    _task: asyncio.Task[None] | None = None
    _nvml: NvmlSampler = field(default_factory=NvmlSampler)

    async def _loop(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                try:
                    async with session.get(f"{self.url}/metrics") as response:
                        text = await response.text()
                    sample = parse_server_sample(text, time.perf_counter())
                    gpu = self._nvml.utilisation()
                    if gpu is not None:
                        sample = ServerSample(**{**sample.__dict__, "gpu_utilisation": gpu})
                    self.samples.append(sample)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    self.errors += 1
                await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # the cancel we just asked for
                await self._task
            self._task = None
