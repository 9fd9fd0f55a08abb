"""Seeded synthetic workloads: the same seed gives the same requests in every tool.

Prompts are token-id lists (the completions API accepts them), so prompt lengths are exact
whatever the tokenizer; output lengths are exact because requests set ``ignore_eos``. Prompt
lengths come from weighted buckets (default short 16-64, medium 128-384, long 512-1024 tokens
at 0.5/0.3/0.2); output lengths are fixed, uniform, or exponential and capped (default mean
128 within [8, 512], as in Anyscale's continuous-batching study).

Standard library only, so the offline engine benchmark can import it too::

    from iterserve.loadtests.workload import make_workload
    requests = make_workload(256, seed=0, vocab_size=4096)

    python -m iterserve.loadtests.workload --num-requests 8 --seed 0   # JSON lines on stdout
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OUTPUT_KINDS = ("fixed", "uniform", "exponential")


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


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt_token_ids: list[int] = field(repr=False)
    max_tokens: int
    bucket: str

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def completion_body(self, model: str, stream: bool = True) -> dict[str, Any]:
        """An OpenAI /v1/completions body with exact lengths (token-id prompt, ignore_eos)."""
        body: dict[str, Any] = {
            "model": model, "prompt": self.prompt_token_ids, "max_tokens": self.max_tokens,
            "min_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


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
        requests.append(WorkloadRequest(index, token_ids, max_tokens, bucket.name))
    return requests


def arrival_offsets(num_requests: int, rate: float, seed: int = 0,
                    burstiness: float = 1.0) -> list[float]:
    """Send times (seconds from start) for an open-loop run, vLLM-style.

    Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): burstiness 1 is a Poisson
    process, < 1 burstier, large values nearly constant. ``rate=inf`` sends all at t=0.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 1_000_003)  # a stream independent of the request contents
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


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


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags every tool shares (bench, locust via env, this module's CLI)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-buckets", type=parse_buckets, default=DEFAULT_PROMPT_BUCKETS,
                        help="name:low-high:weight,... (default short 16-64 0.5, medium "
                             "128-384 0.3, long 512-1024 0.2)")
    parser.add_argument("--output-lengths", type=parse_output_lengths,
                        default=OutputLengths(),
                        help="fixed:N | uniform:LO-HI | exponential:MEAN:LO-HI "
                             "(default exponential:128:8-512)")
    parser.add_argument("--vocab-size", type=int, default=4096)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    add_workload_arguments(parser)
    args = parser.parse_args(argv)
    for request in make_workload(args.num_requests, args.seed, prompt_buckets=args.prompt_buckets,
                                 output_lengths=args.output_lengths, vocab_size=args.vocab_size):
        print(json.dumps({"index": request.index, "bucket": request.bucket,
                          "max_tokens": request.max_tokens,
                          "prompt_token_ids": request.prompt_token_ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
