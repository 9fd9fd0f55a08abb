"""The records that pass between the scheduler, the runner and the engine's callers.

One engine iteration is:
    Scheduler.schedule() -> SchedulerOutput
    Runner.execute(SchedulerOutput) -> RunnerOutput      (or launch(...).result(), async)
    Scheduler.update(SchedulerOutput, RunnerOutput) -> list[Request] that got a token

Under async scheduling step N+1 is scheduled (and launched) before step N's RunnerOutput is
known; see `replica/llm_engine.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from iterserve.replica.logprobs import PromptLogprobsChunk, TokenLogprobs
from iterserve.replica.request import Request

if TYPE_CHECKING:
    from iterserve.replica.host_kv_tier import BlockBytes
    from iterserve.replica.kv_tier_plans import DiskSpill


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of this iteration.

    The runner computes tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of
    `request.all_token_ids`. When that reaches the end of the request's tokens the runner
    samples one new token for it (`samples` is True); a prefill chunk that stops short does
    not. The scheduler sets `samples` when it plans the step (under async scheduling the last
    input token may still be in flight); left None, it is derived from the request.
    """

    request: Request
    num_computed_tokens: int  # tokens already in the KV cache before this step
    num_new_tokens: int  # tokens to compute this step (a decode is 1)
    block_table: list[int]  # physical blocks, enough for num_computed + num_new tokens
    # A finished row of a static batch, recomputed only to keep the batch's shape: its key
    # and value are not written (slot -1) and nothing is sampled.
    is_padding: bool = False
    samples: bool | None = None  # None: derived in __post_init__ (a bool afterwards)

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = (not self.is_padding and self.num_computed_tokens
                            + self.num_new_tokens >= self.request.num_tokens)

    @property
    def sample_position(self) -> int:
        """Index into the request's output tokens of the token this step samples."""
        return self.num_computed_tokens + self.num_new_tokens - self.request.num_prompt_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.num_computed_tokens > 0 and self.samples


@dataclass
class SchedulerOutput:
    """What the runner must compute in one iteration: a flat batch of decodes and chunks.

    `scheduled` holds decodes first, then prefill chunks, in the order the runner lays them
    out. `preempted` is informational: those requests' blocks were already freed. A runner
    runs `kv_spills`, `kv_stores`, `kv_disk_loads`, `kv_loads`, then the forward.
    The sum of `num_new_tokens` is at most max_num_batched_tokens and len(scheduled) at
    most max_num_seqs.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # KV copies to run before the forward, stores first (replica/block_manager.py): device
    # blocks into host-tier slots (block, slot), then host slots into device blocks (slot,
    # block). Empty without a host KV tier.
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    # The disk tier's part (empty without one): host slots whose evicted block goes to disk
    # (kv_tier_plans.DiskSpill), read before this step's stores overwrite them; blocks read
    # back from disk or received from a peer into host slots (slot, payload), written before
    # the loads copy them on.
    kv_spills: list[DiskSpill] = field(default_factory=list)
    kv_disk_loads: list[tuple[int, BlockBytes]] = field(default_factory=list)
    # The (device block, host slot) writes this step's copies and forward make, closed when
    # it has finished (replica/kv_write_generations.py).
    kv_writes: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)


@dataclass
class RunnerOutput:
    """The runner's answer for one SchedulerOutput, keyed by request id.

    Only requests whose ScheduledRequest.samples is True appear in `sampled_token_ids`.
    `failed` names the requests whose own work raised (preparing or sampling one row): the
    engine finishes each alone with an error; their batch mates' results stand.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Requests with SamplingParams.prompt_logprobs whose prefill chunk ran this step.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> what went wrong

    def merge(self, other: RunnerOutput) -> None:
        """Add the results of a disjoint set of requests (a step run in parts)."""
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.failed.update(other.failed)


@dataclass
class RequestOutput:
    """A delta streamed to the caller for one (child) request.

    `new_token_ids` / `new_text` hold only what is new since the previous output;
    `finish_reason` is "stop", "length", "abort" or "error" on the last output and None
    before; with "error", `error` says what failed (the caller raises it to its client).
    `prompt_logprobs` (only with SamplingParams.prompt_logprobs) comes once, on the first
    output with a token: one entry per prompt position, the first None.
    """

    request_id: str
    index: int  # child index for n > 1, else 0
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: str | None = None  # why this request alone failed (a fault, a grammar dead end)
