"""The one workload model's request (`WorkloadRequest`) and the benchmark's seeded workload.

The same seed gives the same requests in every tool. Prompts are token-id lists (the
completions API accepts them), so prompt lengths are exact whatever the tokenizer; output
lengths are exact because requests set ``ignore_eos``. Prompt lengths come from weighted
buckets (default short 16-64, medium 128-384, long 512-1024 tokens at 0.5/0.3/0.2); output
lengths are fixed, uniform, or exponential and capped (default mean 128 within [8, 512], as
in Anyscale's continuous-batching study)::

    from iterserve.autoscale.sim.workload import make_workload
    requests = make_workload(256, seed=0, vocab_size=4096)

    python -m iterserve.loadtests.workload --num-requests 8 --seed 0   # JSON lines on stdout

Arrival processes live in `arrivals.py`, the cluster simulator's named shapes in
`shapes.py`, recorded traces in `traces.py`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

OUTPUT_KINDS = ("fixed", "uniform", "exponential")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: when it arrives, its prompt, how many tokens it generates.

    The one request type of every workload: the simulator's shapes and traces, the Ray
    experiments, `iterserve bench`, the offline benchmark and Locust all make and send these.
    arrival_time: seconds after the run's start (0 where a closed loop sends it). kind: the
    part of its workload's shape it comes from (a length bucket, "long" or "short").

    output_token_id: the token the simulated model emits at every output position. A
    multi-turn workload puts `[output_token_id] * max_tokens` of turn k into the prompt of
    turn k + 1, so that the replica's prefix cache can hold the whole conversation, as it
    would with the real model's answer.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: Sequence[int]  # a list, a tuple, or a SyntheticPrompt
    max_tokens: int
    session_id: str | None = None
    output_token_id: int = 1
    kind: str = ""
    tenant: str | None = None  # whose request (multi-tenant): `tenant_salt` salts by it
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens must be >= 1")
        if not self.prompt_token_ids:
            raise ValueError(f"{self.request_id}: the prompt is empty")
        if self.arrival_time < 0 or math.isnan(self.arrival_time):
            raise ValueError(f"{self.request_id}: arrival_time must be >= 0")


@dataclass(frozen=True)
class LengthBucket:
    name: str
    low: int  # inclusive
    high: int  # inclusive
    weight: float

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"bucket {self.name!r}: need 1 <= low <= high, got "
                             f"{self.low}..{self.high}")
        if self.weight < 0:
            raise ValueError(f"bucket {self.name!r}: weight must be >= 0")


DEFAULT_PROMPT_BUCKETS = (
    LengthBucket("short", 16, 64, 0.5),
    LengthBucket("medium", 128, 384, 0.3),
    LengthBucket("long", 512, 1024, 0.2),
)


@dataclass(frozen=True)
class OutputLengths:
    """How many tokens each request generates: ``fixed`` (= high), ``uniform`` in
    [low, high], or ``exponential`` with `mean`, clamped to [low, high]."""

    kind: str = "exponential"
    mean: float = 128.0
    low: int = 8
    high: int = 512

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(f"unknown output length kind {self.kind!r}; choose {OUTPUT_KINDS}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "exponential" and self.mean <= 0:
            raise ValueError("exponential output lengths need mean > 0")

    @classmethod
    def fixed(cls, tokens: int) -> OutputLengths:
        return cls("fixed", float(tokens), tokens, tokens)

    @classmethod
    def uniform(cls, low: int, high: int) -> OutputLengths:
        return cls("uniform", (low + high) / 2, low, high)

    @classmethod
    def exponential(cls, mean: float = 128.0, low: int = 8, high: int = 512) -> OutputLengths:
        return cls("exponential", mean, low, high)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.high
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(self.low, round(rng.expovariate(1.0 / self.mean))))


def make_workload(
    num_requests: int,
    seed: int = 0,
    *,
    prompt_buckets: Sequence[LengthBucket] = DEFAULT_PROMPT_BUCKETS,
    output_lengths: OutputLengths | None = None,
    vocab_size: int = 4096,
    min_token_id: int = 16,
    max_model_len: int | None = None,
) -> list[WorkloadRequest]:
    """`num_requests` requests drawn from one `random.Random(seed)`.

    Token ids are uniform in [min_token_id, vocab_size); the low ids are skipped because small
    vocabularies keep special tokens there (the tiny model's are 0-4). With `max_model_len`, a
    request whose prompt + output would not fit raises ValueError rather than being trimmed.
    """
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"need 0 <= min_token_id < vocab_size, got {min_token_id}, {vocab_size}")
    if not prompt_buckets or sum(b.weight for b in prompt_buckets) <= 0:
        raise ValueError("prompt_buckets needs at least one bucket with positive weight")
    outputs = output_lengths or OutputLengths()
    rng = random.Random(seed)
    weights = [bucket.weight for bucket in prompt_buckets]
    requests = []
    for index in range(num_requests):
        bucket = rng.choices(prompt_buckets, weights=weights)[0]
        prompt_len = rng.randint(bucket.low, bucket.high)
        max_tokens = outputs.sample(rng)
        if max_model_len is not None and prompt_len + max_tokens > max_model_len:
            raise ValueError(f"request {index}: {prompt_len} prompt + {max_tokens} output "
                             f"tokens exceed max_model_len {max_model_len}")
        token_ids = [rng.randrange(min_token_id, vocab_size) for _ in range(prompt_len)]
        requests.append(WorkloadRequest(str(index), 0.0, token_ids, max_tokens,
                                        kind=bucket.name))
    return requests


def parse_buckets(spec: str) -> tuple[LengthBucket, ...]:
    """``"short:16-64:0.5,long:512-1024:0.5"`` -> buckets."""
    buckets = []
    for part in spec.split(","):
        try:
            name, span, weight = part.split(":")
            low, high = span.split("-")
            buckets.append(LengthBucket(name, int(low), int(high), float(weight)))
        except ValueError as error:
            raise ValueError(f"bad bucket {part!r}: want name:low-high:weight ({error})") from None
    return tuple(buckets)


def parse_output_lengths(spec: str) -> OutputLengths:
    """``fixed:128`` | ``uniform:8-512`` | ``exponential:128:8-512``."""
    kind, _, rest = spec.partition(":")
    try:
        if kind == "fixed":
            return OutputLengths.fixed(int(rest))
        if kind == "uniform":
            low, high = rest.split("-")
            return OutputLengths.uniform(int(low), int(high))
        if kind == "exponential":
            mean, _, span = rest.partition(":")
            low, high = (span or "8-512").split("-")
            return OutputLengths.exponential(float(mean or 128), int(low), int(high))
    except ValueError as error:
        raise ValueError(f"bad output lengths {spec!r}: {error}") from None
    raise ValueError(f"bad output lengths {spec!r}: kind must be one of {OUTPUT_KINDS}")
