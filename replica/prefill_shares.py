"""Each tenant's share of one step's prefill tokens while tenants contend (the fair policy).

The step in flight when a light tenant's request arrives is what its first token waits out
first, and under a backlogged tenant's flood that step is full of the backlogged tenant's
prompts (loadtests/studies/fair_share: at the default 2,048-token budget a step carried up
to ~1,500 of them, ~0.3 s at 0.2 ms a token). So while two or more tenants of a band have
requests waiting or running, each one's prompt tokens in a step (running prefill chunks and
newly admitted prompts; decodes are one token each and never capped) are held to its
weighted share of the budget: `budget * weight / sum of the band's present weights`, at
least one token. A tenant alone in its band takes the whole budget, so one tenant keeps
today's steps (work-conserving), and the steps of contending tenants are as short as a
smaller budget would make them, without a user retuning it.

Bands are shared separately: a more important band's tenants are not slowed down for a less
important band's (strict priority, as the fair queue orders them).

vLLM's nearest knob, `--long-prefill-token-threshold`, caps every request's chunk whether or
not anyone else waits; this caps a tenant's sum, and only while another tenant is present.
"""

from __future__ import annotations

from collections.abc import Iterable

from iterserve.replica.fair_queue import Flow
from iterserve.replica.request import Request


class PrefillShares:
    """The prefill tokens each contending (band, tenant) may still take in this step; a flow
    not listed (alone in its band) is not capped."""

    def __init__(self, left: dict[Flow, int]) -> None:
        self._left = left

    def tokens_left(self, request: Request, budget: int) -> int:
        """How many of the step's `budget` tokens left this request's prefill may take."""
        left = self._left.get((request.priority, request.tenant))
        return budget if left is None else min(budget, left)

    def spend(self, request: Request, num_tokens: int) -> None:
        flow = (request.priority, request.tenant)
        if flow in self._left:
            self._left[flow] -= num_tokens


def step_prefill_shares(present: Iterable[tuple[Flow, float]], budget: int
                        ) -> PrefillShares | None:
    """The shares of one step of `budget` tokens between the present flows (each with its
    tenant's weight: a request waiting or running), or None when no band has two tenants."""
    bands: dict[int, dict[str, float]] = {}
    for (band, tenant), weight in present:
        bands.setdefault(band, {})[tenant] = weight
    left: dict[Flow, int] = {}
    for band, weights in bands.items():
        if len(weights) < 2:
            continue
        total = sum(weights.values())
        for tenant, weight in weights.items():
            left[(band, tenant)] = max(1, int(budget * weight / total))
    return PrefillShares(left) if left else None
