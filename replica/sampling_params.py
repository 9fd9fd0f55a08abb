"""Per-request sampling parameters, validated at construction with ValueError."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from iterserve.replica.structured_spec import StructuredSpec

# A seed seeds a torch.Generator, which takes a 64-bit integer: vLLM bounds it by
# torch.iinfo(torch.long). Children of an n > 1 request add their index, which still fits.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, with vLLM's names and meanings.

    temperature 0 is greedy. `seed` makes one request's samples reproducible whatever its
    batch mates are. `n` > 1 runs n child requests that share the prompt's KV blocks.

    `prompt_logprobs` (k >= 0) asks, for every prompt position after the first, for the
    log-probability of the actual prompt token and the top-k alternatives (position 0 has
    none). Every prompt position must then be computed, so such a request takes no
    prefix-cache hits (its own blocks are still cached for others to hit).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; None for none
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token; None for none
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra_eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Output constraints (replica/structured_output.py, replica/logit_controls.py).
    structured: StructuredSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict works
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._normalize_logit_controls()
        self._validate()

    def _normalize_logit_controls(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids",
                               tuple(int(t) for t in self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))

    @property
    def has_logit_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def has_constraint(self) -> bool:
        """Whether the sampler must look at this request beyond penalties and temperature."""
        return self.structured is not None or self.has_logit_controls

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be >= 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias maps token ids >= 0 to biases in [-100, 100]"),
            (self.allowed_token_ids is None or (
                len(self.allowed_token_ids) > 0 and all(t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids >= 0"),
            (all(isinstance(w, str) and w for w in self.bad_words),
             "bad_words must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
