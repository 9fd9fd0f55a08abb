"""The KV-aware router's score and the per-replica terms it is made of (no Ray, no clock reads).

`KVRouterCore` (router_state.py) ranks with this score, computed by its `ScoreTable`
(router_table.py); tests/router_oracle.py spells it out one replica at a time, and
tests/unit/test_router_table.py holds the two to the same decisions.

The score
---------
For each candidate replica r, with its last reported load L (possibly stale) and c = the
number of requests *this router* sent to r that r's stats cannot reflect yet (routed after
L.timestamp and not yet seen complete):

    eff_waiting = L.num_waiting + c   (with drain_inflight_waiting, only those of the c still
                  in the drained prefill queue below, as of the last of them, count)
    eff_kv      = min(1, max(L.kv_usage + k, K))
    K           = committed KV: the prompt + max_tokens of every request this router sent r
                  and has not seen complete, over r's KV tokens (use_committed_kv). Unlike
                  kv_usage it counts the blocks that waiting requests and the decodes still
                  to come will need: the growth that causes preemption and the blocked
                  head of a FCFS queue that stalls everything behind it.
    k           = t / (L.num_total_blocks * prefix_block_size)   if the router knows the
                  unseen requests' prompt tokens t and the replica's KV size, else
                  inflight_kv_per_request * c
    r           = this request's own KV share: request_tokens (prompt + max_tokens) over the
                  replica's KV tokens, or inflight_kv_per_request when either is unknown
    tier        = 2 if L.draining
                  1 if eff_kv + r >= kv_high_watermark or eff_waiting >= max_waiting
                  0 otherwise          ("would this request push the replica over the line?")
    prefill     = (U + P - H) / prefill_tokens_per_waiting     (score_prefill_work)
    U           = uncached prompt tokens of the requests this router sent r that r's stats
                  do not reflect yet (queued ahead of this one; with drain_inflight_prefill,
                  r's reported queued prefill plus those, less what r's prefill_token_rate
                  computed since, `queued_prefill`); P = this prompt's tokens;
                  H = how many leading tokens of it r holds in its prefix cache (the
                  replica's own answer, `cached_tokens`; 0 when unknown)
    sent        = w * (W_r - min over candidates W) / prefill_tokens_per_waiting
    w           = routed_work_weight * (1 - the largest share of this prompt any replica
                  caches): where a replica holds the prefix, the cache term decides
    W_r         = uncached prompt tokens this router sent r, decayed with
                  routed_work_half_life_s (`RoutedWorkMeter`; none given: 0)
    score       = waiting_weight * eff_waiting + kv_weight * eff_kv + prefill + sent

Replicas are sorted by (tier, score), ties kept in candidate order (the Ray adapter shuffles
candidates first so that independent routers do not all pick the same replica). With the
default weights one waiting request costs as much as a whole KV cache, so this is
"fewest waiting, then lowest KV usage" with a continuous tie-break. A replica with no stats
yet scores as idle plus its correction c (a just-started replica is idle). A replica whose
stats are older than stats_stale_after_s keeps its last stats plus every request routed to
it since, and is ranked in tier 1: a replica too busy to answer the stats poll is more
likely overloaded than idle.

Cache affinity over the replicas' answers (`cache_affinity_first`), after sorting: the
best-ranked replica holding the longest cached prefix of the prompt, if that is at least
cache_affinity_threshold of it, goes first when it is in tier 0 and its score without the
routed-work balance is within cache_affinity_slack of the leader's; where no replica holds
any of it yet, the replica the affinity table last sent its key to (its first request may
still be prefilling) is tried the same way. This is Ray's and SGLang's "route by cache
match above a threshold, else balance by routed tokens", under our load guard: without it
the balance term pulls a session's or a tenant's growing prefix off the replica that has it.

Prefill work makes the score size-aware: a replica that was just sent two 6k-token prompts
is further behind than one sent two 100-token prompts, and a replica that caches 6k tokens
of this prompt saves that much prefill. Where the replicas' cache answers are known the
affinity table below is not consulted: the cache term already says where the prefix is.

Prefix affinity: a prompt's key is a hash of its first min(prefix_num_blocks, full blocks)
blocks of prefix_block_size tokens. If the affinity table maps that key to a candidate in
tier 0 whose score is within prefix_affinity_slack of the best tier-0 score, that replica
moves to the front: it probably still holds the prefix's KV blocks, so its prefill is cheap.
Over the watermark (tier >= 1) or too far behind, load wins and the key is re-homed to the
replica the request is actually routed to.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Generic, TypeVar

from iterserve.autoscale.config import RouterConfig

# InFlightTracker lives in router_inflight; imported from here by its callers too.
from iterserve.autoscale.router_inflight import Correction, InFlightTracker  # noqa: F401
from iterserve.autoscale.signals import ReplicaLoad

R = TypeVar("R", bound=Hashable)  # a replica id: a string in tests, a Serve ReplicaID in Ray

TIER_OK = 0
TIER_HOT = 1  # over the KV watermark or with a full waiting queue
TIER_DRAINING = 2


def prefix_hash(token_ids: Sequence[int], block_size: int, num_blocks: int) -> int | None:
    """Hash of the prompt's leading full blocks (at most num_blocks), None if under a block.

    Stable across processes (blake2b, not Python's salted hash()), so every router and every
    run agree on the key.
    """
    n_full = min(len(token_ids) // block_size, num_blocks)
    if n_full <= 0:
        return None
    prefix = token_ids[: n_full * block_size]
    try:  # the same bytes as the spelled-out form below, at C speed
        data = struct.pack(f"<{len(prefix)}I", *prefix)
    except struct.error:  # not all uint32 ints: that form converts, or raises OverflowError
        data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in prefix)
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") ^ n_full


def _as_correction(value: int | Correction | None) -> Correction:
    if value is None:
        return Correction(0)
    if isinstance(value, Correction):
        return value
    return Correction(max(0, int(value)))


def _kv_of(correction: Correction, load: ReplicaLoad | None, config: RouterConfig) -> float:
    kv_tokens = 0 if load is None else load.num_total_blocks * config.prefix_block_size
    if correction.prompt_tokens > 0 and kv_tokens > 0:
        return correction.prompt_tokens / kv_tokens
    return config.inflight_kv_per_request * correction.requests


def effective_load(
    load: ReplicaLoad | None,
    correction: int | Correction,
    now: float | None,
    config: RouterConfig,
) -> tuple[int, float, bool, bool]:
    """(eff_waiting, eff_kv, queue_full_or_hot, stale) for one replica."""
    corr = _as_correction(correction)
    if load is None:  # no stats yet: a new replica, idle but for what we sent it
        eff_waiting = corr.requests
        eff_kv = min(1.0, _kv_of(corr, load, config))
        max_waiting = config.max_waiting_per_replica
        return eff_waiting, eff_kv, _hot(eff_waiting, eff_kv, max_waiting, config), False
    stale = now is not None and now - load.timestamp > config.stats_stale_after_s
    eff_waiting = load.num_waiting + (corr.requests if corr.waiting is None else corr.waiting)
    eff_kv = min(1.0, max(load.kv_usage + _kv_of(corr, load, config),
                          _committed_kv(corr, load, config)))
    max_waiting = config.max_waiting_per_replica or load.max_waiting_requests
    hot = stale or _hot(eff_waiting, eff_kv, max_waiting, config)
    return eff_waiting, eff_kv, hot, stale


def prefill_queue(correction: Correction, load: ReplicaLoad | None, config: RouterConfig
                  ) -> tuple[float, float | None]:
    """(U, as_of): the prefill tokens queued at the replica as this router knows them, and
    the time they are counted at (None: not drained, U counts in full until new stats).
    With drain_inflight_prefill and a replica that reports its prefill_token_rate: its
    reported queue at its stats, plus the unseen sends, drained between them (the
    tracker's `Correction.prefill_as_of`; where a correction was not drained, its sends
    are counted as if made at the stats' time)."""
    if correction.prefill_as_of is not None:
        return correction.prefill_tokens, correction.prefill_as_of
    if config.drain_inflight_prefill and load is not None and load.prefill_token_rate > 0:
        return correction.prefill_tokens + load.queued_prefill_tokens, load.timestamp
    return correction.prefill_tokens, None


def _committed_kv(correction: Correction, load: ReplicaLoad, config: RouterConfig) -> float:
    """KV the replica will need for what this router sent it (prompts + max_tokens)."""
    kv_tokens = load.num_total_blocks * config.prefix_block_size
    if not config.use_committed_kv or kv_tokens <= 0:
        return 0.0
    return correction.committed_tokens / kv_tokens


def _hot(eff_waiting: int, eff_kv: float, max_waiting: int | None, config: RouterConfig) -> bool:
    return eff_kv >= config.kv_high_watermark or (
        max_waiting is not None and eff_waiting >= max_waiting
    )


def to_rank_groups(ranked: Sequence[R]) -> list[list[R]]:
    """One replica per rank: Serve tries rank 0 first, then 1, ... (it skips a replica at
    max_ongoing_requests). Grouping would let Serve re-pick inside a group by queue length."""
    return [[rid] for rid in ranked]


class PrefixAffinityTable(Generic[R]):
    """LRU map prefix hash -> replica id, owned by one router (plain data, no clock)."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._max_entries = max_entries
        self._table: OrderedDict[int, R] = OrderedDict()

    def record(self, key: int | None, replica_id: R) -> None:
        if key is None:
            return
        self._table[key] = replica_id
        self._table.move_to_end(key)
        while len(self._table) > self._max_entries:
            self._table.popitem(last=False)

    def forget_replica(self, replica_id: R) -> None:
        for key in [k for k, v in self._table.items() if v == replica_id]:
            del self._table[key]

    def as_mapping(self) -> Mapping[int, R]:
        return self._table

    def __len__(self) -> int:
        return len(self._table)
