"""When the ingress holds requests: no replica has room for one more.

A replica has room while (1) its requests in flight (sent to it and not yet answered, as
the ingress counts them) are fewer than the batch it can run at once, the engine's
`max_num_seqs`; (2) the prompt tokens it has not prefilled yet are fewer than one step's
token budget, the engine's `max_num_batched_tokens`; and (3) its KV cache is below
`kv_usage_limit`.

Why those bounds: a request sent to a replica whose batch is full, or that has more than a
step of prompts still to prefill, waits there behind work the engine has already accepted,
where it can no longer be reordered; a light tenant's request then waits out a deep queue,
and steps full of the heavy tenant's prompts, even when its engine puts it first. Sent only
where the batch has a free place and the next step has budget left for its prompt, a
request starts prefilling at its replica's next step, so the only queue with any depth is
the ingress's, and the ingress's order (fair, cluster-wide) is the order served. The
replicas still run full: a freed place, or a step's prefill budget once spent, is taken
by the next held request at once, so the cost is the step a freed place waits for it. The
KV limit keeps the running decodes room to grow before the engine must preempt (a
preemption is the tail this is meant to avoid); llm-d's saturation detector's default is
0.8, here 0.9 since in-flight requests are already capped by the batch.

The prompt tokens not yet prefilled are what the ingress can count itself (the prompts it
sent whose first token has not come back) or what the replica reports
(`ReplicaLoad.queued_prefill_tokens`); the simulator reads the engine's exact count.
The test is a pure function over each replica's numbers: the simulator's cluster and the
live ingress ask the same question of the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class IngressSaturation:
    """A replica has room while in flight < max_in_flight, prompt tokens not yet
    prefilled < max_queued_prompt_tokens, and KV usage < kv_usage_limit."""

    max_in_flight: int = 256  # the engine's max_num_seqs (replica/config.py's default)
    max_queued_prompt_tokens: int = 2048  # the engine's max_num_batched_tokens
    kv_usage_limit: float = 0.9

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_queued_prompt_tokens < 1:
            raise ValueError("max_queued_prompt_tokens must be >= 1, got "
                             f"{self.max_queued_prompt_tokens}")
        if not 0 < self.kv_usage_limit <= 1:
            raise ValueError(f"kv_usage_limit must be in (0, 1], got {self.kv_usage_limit}")


@dataclass(frozen=True)
class ReplicaRoom:
    """What the test reads of one replica."""

    in_flight: int
    queued_prompt_tokens: int
    kv_usage: float


def replica_has_room(replica: ReplicaRoom, saturation: IngressSaturation) -> bool:
    """Whether one more request may go to this replica now."""
    return (replica.in_flight < saturation.max_in_flight
            and replica.queued_prompt_tokens < saturation.max_queued_prompt_tokens
            and replica.kv_usage < saturation.kv_usage_limit)


def cluster_has_room(replicas: Iterable[ReplicaRoom], saturation: IngressSaturation) -> bool:
    """Whether any replica has room: else the ingress holds."""
    return any(replica_has_room(r, saturation) for r in replicas)
