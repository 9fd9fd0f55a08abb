"""A request as the scheduler sees it: token ids, how many are computed, and its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from iterserve.replica.block_keys import CacheNamespace
from iterserve.replica.logprobs import PromptLogprobsChunk, TokenLogprobs
from iterserve.replica.sampling_params import SamplingParams

if TYPE_CHECKING:  # logit_controls needs torch, which a request does not
    from iterserve.replica.logit_controls import RequestConstraint


@dataclass(frozen=True)
class TenantShare:
    """Who a request is served for, as the fair policy weighs it: the tenant's name and its
    weight (deploy/tenants.py's TenantConfig), carried from the ingress to the engine."""

    name: str = ""
    weight: float = 1.0
    # Its tenant's time-to-first-token objective: a request predicted to miss it is refused
    # at once (replica/slo_admission.py); None: admitted whatever the wait.
    ttft_slo_ms: float | None = None
    # What its ingress measured its recent requests to spend outside the engine before their
    # first token (deploy/outside_engine.py): the objective leaves room for it.
    ttft_outside_engine_s: float = 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed in the engine (its client gets an error)

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
     RequestStatus.FINISHED_ERROR}
)


@dataclass(eq=False, slots=True)
class Request:
    """One sequence: a prompt, its generated tokens and its progress through the KV cache.

    The single scheduling rule: num_computed_tokens catches up with num_tokens. A prefill is
    the case num_tokens - num_computed_tokens > 1, a decode the case == 1; preemption resets
    num_computed_tokens to 0 and keeps output_token_ids, so recompute replays them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower value runs first under the priority policy (vLLM's convention)
    eos_token_ids: frozenset[int] = frozenset()
    index: int = 0  # child index when n > 1
    parent_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens in the KV cache, or scheduled into it by a step
    # Tokens being sampled by steps still in flight (async scheduling): counted as tokens to
    # compute, so the next step is planned before they are known. Always 0 when synchronous.
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    error: str | None = None  # why the engine failed this request alone (FINISHED_ERROR)
    num_preemptions: int = 0
    admitted_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    # Grammar matcher and logit controls, one per child; None costs the sampler nothing.
    constraint: RequestConstraint | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt position scored so far, the
    # first (position 0, nothing before it) None. Kept across preemption.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Set by the scheduler when it takes the request (`Scheduler.add_request`): the output
    # length at which it must stop (max_tokens, or the model's context) and the ids that may
    # stop it, so a step's stop check is one set lookup and one comparison until either can
    # fire. The defaults send every token through the full check.
    output_length_limit: int = 0
    stopping_token_ids: frozenset[int] = frozenset()
    # The prompt's tokens, or its leading ones, packed as int64 (`array("q", prompt[:k])
    # .tobytes()`), where the caller has them for less than that conversion (the cluster
    # simulator's synthetic prompts): the block manager slices its prefix-cache keys from it
    # where it reaches. None, or beyond it: the block manager converts the tokens.
    prompt_token_bytes: bytes | None = None
    # The namespace its cached blocks live in (block_keys.cache_namespace: a salt, an
    # adapter): it shares cached blocks only with requests of the same namespace.
    cache_namespace: CacheNamespace = b""
    # The LoRA adapter it runs with (its model name in the API), None for the base model.
    lora_name: str | None = None
    # Its tenant and weight (the fair policy's virtual token counters; "" and 1: no tenant).
    tenant: str = ""
    tenant_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.wants_prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs.append(None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        # Spelled out rather than through num_tokens: the scheduler reads it per request per step.
        return (len(self.prompt_token_ids) + len(self.output_token_ids)
                + self.num_output_placeholders - self.num_computed_tokens)

    @property
    def sampling_reads_output(self) -> bool:
        """Whether sampling its next token reads its previous output tokens (penalties over
        them, or min_tokens still masking stop tokens). Under async scheduling such a request
        is not planned past a token still being sampled: it waits one step, so its sampling
        sees every earlier token. Grammar-constrained requests belong here too."""
        params = self.sampling_params
        return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0
                or len(self.output_token_ids) < params.min_tokens)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate: its KV footprint at worst."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    # ------------------------------------------------------------------ prompt logprobs
    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_logprobs_held(self) -> int:
        """Prompt positions already scored; the next chunk starts scoring here."""
        return len(self.prompt_logprobs)

    def record_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Append a chunk's entries; positions already held (a recompute after preemption,
        or a step scheduled before the previous one was recorded) are skipped."""
        held = len(self.prompt_logprobs)
        if chunk.first_position > held:
            raise RuntimeError(f"request {self.request_id}: prompt logprobs from position "
                               f"{chunk.first_position} but only {held} held")
        self.prompt_logprobs.extend(chunk.entries[held - chunk.first_position:])
