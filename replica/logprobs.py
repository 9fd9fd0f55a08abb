"""Log-probabilities as the engine hands them out: per sampled token and per prompt chunk.

Plain data with no imports of the engine's own, so that `Request` (which holds them) and
`outputs` (which carries them) both import this module and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many tokens are more likely (ties count as ahead)


@dataclass
class PromptLogprobsChunk:
    """Prompt log-probabilities computed in one step: positions first_position, ... in order.

    Entry i scores prompt token first_position + i given the tokens before it.
    """

    first_position: int
    entries: list[TokenLogprobs]
