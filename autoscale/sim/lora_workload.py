"""A workload whose requests name LoRA adapters of Zipf popularity (issue 44's cells).

Adapter k (k = 1..num_adapters, named "lora-k") is drawn with weight 1 / k**zipf_a, from a
stream seeded by the seed alone, so the same seed names the same adapters in every cell; a
`base_fraction` of the requests name none (the base model). A request's prompt moves into
its adapter's cache namespace (`block_keys.with_adapter`, as the engine keys an adapter's
blocks): the same prompt under two adapters shares no cached block, in the replicas' caches
and in the cluster's prefix index alike.

reversed_from_s: requests arriving from then on draw the ranks reversed (the coldest adapter,
"lora-<num_adapters>", becomes the hottest): an adapter that turns hot after the replicas
placed it while it was cold, the case in which Ray Serve's multiplexing pins it (ray#65691).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
from collections.abc import Sequence

from iterserve.autoscale.sim.prompts import SyntheticPrompt
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.block_keys import with_adapter


def adapter_name(rank: int) -> str:
    """The name of the rank-th most popular adapter (1: the hottest)."""
    return f"lora-{rank}"


def zipf_weights(num_adapters: int, zipf_a: float) -> list[float]:
    """Adapter k's share, k = 1..num_adapters: 1 / k**zipf_a, normalised."""
    if num_adapters < 1 or zipf_a < 0:
        raise ValueError("need num_adapters >= 1 and zipf_a >= 0")
    raw = [1.0 / k ** zipf_a for k in range(1, num_adapters + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def with_zipf_adapters(requests: Sequence[WorkloadRequest], num_adapters: int = 100,
                       zipf_a: float = 1.0, base_fraction: float = 0.0, seed: int = 0,
                       reversed_from_s: float | None = None) -> list[WorkloadRequest]:
    """The requests, each naming an adapter (or, with probability base_fraction, none).
    ValueError for a prompt that is not a SyntheticPrompt (the generated shapes' are)."""
    if not 0.0 <= base_fraction <= 1.0:
        raise ValueError("base_fraction must be in [0, 1]")
    cumulative = list(itertools.accumulate(zipf_weights(num_adapters, zipf_a)))
    rng = random.Random(f"lora-adapters/{seed}")
    out = []
    for request in requests:
        base = rng.random() < base_fraction
        draw = rng.random()
        if base:
            out.append(request)
            continue
        # min: the last cumulative share may round below 1.0
        rank = min(num_adapters, 1 + bisect.bisect_left(cumulative, draw))
        if reversed_from_s is not None and request.arrival_time >= reversed_from_s:
            rank = num_adapters + 1 - rank
        name = adapter_name(rank)
        prompt = request.prompt_token_ids
        if not isinstance(prompt, SyntheticPrompt):
            raise ValueError(f"{request.request_id}: only synthetic prompts can name adapters")
        out.append(dataclasses.replace(
            request, adapter=name,
            prompt_token_ids=prompt.in_namespace(with_adapter(prompt.cache_namespace, name))))
    return out

