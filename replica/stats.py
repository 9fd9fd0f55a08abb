"""What the engine reports after every iteration, for routers, autoscalers and metrics.

Three records, all plain data: a snapshot of the engine (`EngineStats`), what happened in
the iteration just run (`IterationStats`) and one record per request that finished in it
(`FinishedRequestStats`). A `StatLogger` receives all three after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from iterserve.replica.request import Request

# How a request ended: vLLM's finish reasons, plus "error" (it failed in the engine).
FINISH_REASONS = ("stop", "length", "abort", "error")
FINISH_REASON_ABORT = "abort"
FINISH_REASON_ERROR = "error"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine, cheap to take and safe to send across processes."""

    timestamp: float  # time.time() when taken
    num_running: int
    num_waiting: int  # includes preempted requests waiting to be recomputed
    num_total_blocks: int
    num_free_blocks: int  # blocks holding no live request (evictable cached blocks count)
    kv_usage: float  # used / total blocks, in [0, 1]
    num_preemptions: int  # cumulative
    num_out_of_blocks: int  # cumulative: steps where a request could not get a block
    last_step_tokens: int  # tokens computed in the last iteration
    step_token_rate: float  # tokens computed per second over the recent window
    # Prompt tokens computed per second of step time, over the recent steps that prefilled
    # (0: none in the window): how fast queued prefill drains, for routers.
    prefill_token_rate: float = 0.0
    queued_prefill_tokens: int = 0  # the scheduler's num_queued_prefill_tokens()
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found cached on the device
    # The host KV tier (0 and empty without one): cumulative prompt tokens the device missed
    # and looked up there, those found there, and the bytes and seconds of the copies by
    # vLLM's transfer_type ("GPU_to_CPU", "CPU_to_GPU").
    host_cache_queries: int = 0
    host_cache_hits: int = 0
    kv_offload_bytes: dict[str, int] = field(default_factory=dict)
    kv_offload_seconds: dict[str, float] = field(default_factory=dict)
    # The disk tier below the host tier (0 and empty without one): prompt tokens the device
    # and the host missed, those read back from disk, and the blocks computed instead of
    # written or read back, by reason (replica/disk_kv_tier.py DISK_ERRORS). Its copies are
    # in kv_offload_bytes / _seconds under "CPU_to_DISK" and "DISK_to_CPU".
    disk_cache_queries: int = 0
    disk_cache_hits: int = 0
    disk_errors: dict[str, int] = field(default_factory=dict)
    max_waiting_requests: int | None = None
    # cumulative requests ended per finish reason (each counted once, when it ends)
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # LoRA (max_loras 0: off): the adapters of the running and of the waiting requests
    max_loras: int = 0
    # KV bytes one token takes in this engine's cache (every layer, K and V; 0: no real KV):
    # what a router prices a copy of cached blocks by (a host-tier read, a pull).
    kv_bytes_per_token: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class IterationStats:
    """What one step did; `idle` is the record of a tick in which no step ran."""

    timestamp: float
    step_time_s: float
    num_prompt_tokens: int  # prefill tokens computed this step
    num_generation_tokens: int  # tokens sampled this step
    num_scheduled_requests: int
    num_preempted: int
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)

    @classmethod
    def idle(cls, timestamp: float) -> IterationStats:
        return cls(timestamp, 0.0, 0, 0, 0, 0)


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str  # one of FINISH_REASONS
    e2e_latency_s: float  # arrival to finish
    queue_time_s: float  # arrival to first admission
    prefill_time_s: float  # first admission to first token
    decode_time_s: float  # first token to finish
    time_to_first_token_s: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int


class StatLogger(Protocol):
    def record(
        self,
        engine: EngineStats,
        iteration: IterationStats,
        finished: list[FinishedRequestStats],
    ) -> None: ...


def finished_request_stats(request: Request, reason: str | None = None) -> FinishedRequestStats:
    """The latencies and token counts of a request that ended (reason: why, if not its own)."""
    end = request.finished_time or request.arrival_time
    admitted = request.admitted_time or end
    first = request.first_token_time
    return FinishedRequestStats(
        finish_reason=reason or request.finish_reason or "abort",
        e2e_latency_s=end - request.arrival_time,
        queue_time_s=admitted - request.arrival_time,
        prefill_time_s=(first - admitted) if first is not None else 0.0,
        decode_time_s=(end - first) if first is not None else 0.0,
        time_to_first_token_s=(first - request.arrival_time) if first is not None else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_generation_tokens=request.num_output_tokens,
        max_tokens=request.sampling_params.max_tokens,
    )
