"""What an LLMEngine reports: `stats()` snapshots and what its stat loggers see.

A mixin of LLMEngine (the seam between stepping and reporting): it reads the engine's
scheduler, block manager, config and clock, and keeps its own counters, set by `init_stats`.
Every request that ends is counted once, under its reason, when it ends; the stats of those
that ended outside a step (aborts, failures) wait for the next record (a step or an idle
tick), so /metrics agrees with the engine whether it steps or not. `cached_block_hashes`
(the prefix cache's stable block hashes, for routers) is asked for on its own: the engine
takes a `stats()` snapshot after every step, and that must not pay for hashing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from iterserve.replica.block_hashes import DISK, BlockHashIndex
from iterserve.replica.outputs import SchedulerOutput
from iterserve.replica.prefill_rate import RATE_WINDOW_S, PrefillRateMeter
from iterserve.replica.request import Request
from iterserve.replica.slo_admission import ActiveTenants, DrainRate
from iterserve.replica.stats import (
    FINISH_REASONS,
    EngineStats,
    FinishedRequestStats,
    IterationStats,
    StatLogger,
    finished_request_stats,
)

if TYPE_CHECKING:
    from iterserve.replica.block_manager import BlockManager
    from iterserve.replica.config import EngineConfig
    from iterserve.replica.disk_kv_tier import DiskKVTier
    from iterserve.replica.host_kv_tier import HostKVTier
    from iterserve.replica.runner_base import Runner
    from iterserve.replica.scheduler import Scheduler


class EngineStatsReporting:
    scheduler: Scheduler
    block_manager: BlockManager
    config: EngineConfig
    clock: Callable[[], float]
    runner: Runner
    num_waiting_requests: int  # LLMEngine's property (held requests included)

    def init_stats(self) -> None:
        self.stat_loggers: list[StatLogger] = []
        self.finished_by_reason: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._unlogged_finished: list[FinishedRequestStats] = []
        self._recent_steps: deque[tuple[float, int]] = deque()
        self.prefill_rate = PrefillRateMeter()
        # Prompt tokens per second of *wall* time while work was pending: what SLO-aware
        # admission predicts a queue's drain with (replica/slo_admission.py). Unlike
        # prefill_rate (per step second, for routers) it counts the engine loop's time
        # between steps and the decode-only steps while prompts wait: the time a queued
        # request really waits. _busy_since: when the current busy stretch's last prefill
        # sample ended (None: the engine had nothing left to do).
        self.prefill_drain_rate = PrefillRateMeter()
        self._busy_since: float | None = None
        # Per band, the tenants admitted lately: SLO admission's fair share is theirs.
        self.active_tenants = ActiveTenants()
        self._last_step_tokens = 0
        # Kept up to date by the block manager as blocks are cached and evicted, so a
        # router's report costs O(hashes reported), not a pass over the whole cache.
        self._block_hashes = BlockHashIndex()
        if self.block_manager.enable_prefix_caching:
            self.block_manager.cache_listener = self._block_hashes
            if self.block_manager.host is not None:  # reported as the "host" tier
                self.block_manager.host.listener = self._block_hashes
        # Only the model runner has a host KV tier (and only when kv_offloading_size is set).
        self._host_tier: HostKVTier | None = getattr(self.runner, "host_tier", None)
        self._disk_tier: DiskKVTier | None = getattr(self.runner, "disk_tier", None)
        # Runners with a KV layout (the model's, the simulated one) know their bytes a block.
        bytes_per_block: int = getattr(self.runner, "kv_bytes_per_block", 0)
        self._kv_bytes_per_token = bytes_per_block // self.config.cache.block_size

    def cached_block_hashes(self) -> dict[str, list[int]] | None:
        """Per KV tier ("device", "host", "disk"), the stable hashes (`block_hashes`) of the
        blocks a prefix lookup would read there now, or None when prefix caching is off.
        The disk tier fills what room the others leave in the report (its own index is
        keyed by the same stable hashes; a block also held above is reported in both, and
        a router counts its best tier). Call on the engine's thread, between steps."""
        if not self.block_manager.enable_prefix_caching:
            return None
        report = self._block_hashes.report()
        if self._disk_tier is not None:
            room = self._block_hashes.limit - sum(len(hashes) for hashes in report.values())
            on_disk = self._disk_tier.recent_hashes(room)
            if on_disk:
                report[DISK] = on_disk
        return report

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.stat_loggers.append(stat_logger)

    def stats(self) -> EngineStats:
        now = self.clock()
        while self._recent_steps and now - self._recent_steps[0][0] > RATE_WINDOW_S:
            self._recent_steps.popleft()
        recent_tokens = sum(tokens for _, tokens in self._recent_steps)
        manager = self.block_manager
        offload_bytes, offload_seconds, disk_errors = self._tier_copies()
        return EngineStats(
            timestamp=time.time(),
            num_running=self.scheduler.num_running,
            num_waiting=self.num_waiting_requests,
            num_total_blocks=manager.num_total_blocks,
            num_free_blocks=manager.num_free_blocks,
            kv_usage=manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_out_of_blocks=self.scheduler.num_out_of_blocks,
            last_step_tokens=self._last_step_tokens,
            step_token_rate=recent_tokens / RATE_WINDOW_S,
            prefill_token_rate=self.prefill_rate.rate(now),
            queued_prefill_tokens=self.scheduler.num_queued_prefill_tokens(),
            prefix_cache_queries=manager.prefix_queries,
            prefix_cache_hits=manager.prefix_hits,
            host_cache_queries=manager.host_queries,
            host_cache_hits=manager.host_hits,
            kv_offload_bytes=offload_bytes,
            kv_offload_seconds=offload_seconds,
            disk_cache_queries=manager.disk_queries,
            disk_cache_hits=manager.disk_hits,
            disk_errors=disk_errors,
            max_waiting_requests=self.config.scheduler.max_waiting_requests,
            finished_by_reason=dict(self.finished_by_reason),
            kv_bytes_per_token=self._kv_bytes_per_token,
            **self._lora_stats(),
        )

    def _tier_copies(self) -> tuple[dict[str, int], dict[str, float], dict[str, int]]:
        """Bytes and seconds copied per transfer type (host tier, then disk tier), and the
        disk tier's errors; empty without tiers."""
        if self._host_tier is None:
            return {}, {}, {}
        copied, seconds = dict(self._host_tier.bytes_copied), dict(self._host_tier.copy_seconds)
        if self._disk_tier is None:
            return copied, seconds, {}
        disk_copied, disk_seconds, errors = self._disk_tier.counters()
        return {**copied, **disk_copied}, {**seconds, **disk_seconds}, errors

    def _lora_stats(self) -> dict[str, object]:
        """EngineStats' LoRA fields: the adapters running and waiting (none without LoRA)."""
        max_loras = self.scheduler.max_loras
        if not max_loras:
            return {}
        running = {r.lora_name for r in self.scheduler.running if r.lora_name}
        unfinished = {r.lora_name for r in self.scheduler.unfinished_requests() if r.lora_name}
        return {"max_loras": max_loras, "running_lora_adapters": tuple(sorted(running)),
                "waiting_lora_adapters": tuple(sorted(unfinished - running))}

    def _count_finished(self, request: Request, reason: str) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        if self.stat_loggers:
            self._unlogged_finished.append(finished_request_stats(request, reason))

    def _take_unlogged_finished(self) -> list[FinishedRequestStats]:
        finished, self._unlogged_finished = self._unlogged_finished, []
        return finished

    def log_idle_stats(self) -> None:
        """The stats tick of an engine that ran no step: gauges show the engine as it is now
        (not as the last step left it), and requests that ended since are counted."""
        if not self.stat_loggers:
            return
        snapshot = self.stats()
        iteration = IterationStats.idle(snapshot.timestamp)
        finished = self._take_unlogged_finished()
        for stat_logger in self.stat_loggers:
            stat_logger.record(snapshot, iteration, finished)

    def drain_rate(self, now: float) -> DrainRate:
        """How fast the admitted prompts drain now (what SLO admission predicts with)."""
        meter = self.prefill_drain_rate
        return DrainRate(meter.rate(now), meter.mean_seconds(now))

    def _record_drain(self, start: float, now: float, prefill_tokens: int) -> None:
        if prefill_tokens:
            busy_from = start if self._busy_since is None else self._busy_since
            self.prefill_drain_rate.record(now, prefill_tokens, now - busy_from)
            self._busy_since = now
        if not self.scheduler.has_unfinished_requests():
            self._busy_since = None
        elif self._busy_since is None:
            self._busy_since = now

    def _record(self, start: float, output: SchedulerOutput, updated: list[Request]) -> None:
        now = self.clock()
        self._last_step_tokens = output.num_batched_tokens
        self._recent_steps.append((now, output.num_batched_tokens))
        self.prefill_rate.record(now, output.num_prefill_tokens, now - start)
        self._record_drain(start, now, output.num_prefill_tokens)
        if not self.stat_loggers:
            return
        ttfts, itls = [], []
        for request in updated:
            if request.num_output_tokens == 1:
                ttfts.append(request.first_token_time - request.arrival_time)
            elif len(request.token_times) >= 2:
                itls.append(request.token_times[-1] - request.token_times[-2])
        iteration = IterationStats(
            timestamp=time.time(),
            step_time_s=now - start,
            num_prompt_tokens=output.num_prefill_tokens,
            num_generation_tokens=len(updated),
            num_scheduled_requests=len(output.scheduled),
            num_preempted=len(output.preempted),
            time_to_first_tokens_s=ttfts,
            inter_token_latencies_s=itls,
        )
        finished_stats = self._take_unlogged_finished()
        snapshot = self.stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(snapshot, iteration, finished_stats)


