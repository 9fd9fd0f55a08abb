"""The router's decision (router_policy's score) from per-replica terms kept between requests.

At 64-256 replicas a router scores every replica for every request, and scoring them one
at a time in Python (as the readable oracle, tests/router_oracle.py, does) spends most of
that on terms that did not change since the previous request: a replica's effective load depends only on
its last stats and this router's in-flight correction for it, and across the whole cluster
only a few of those change between two requests. `ScoreTable` keeps those terms per replica
(a row of one float matrix), recomputes a row only when the replica's stats object or its
correction changed, and does the per-request part (staleness against `now`, this request's
KV share, its uncached prefill, the routed-work balance) as array arithmetic over the
candidates' rows.

Same decision, bit for bit: every float is computed by the same IEEE operations in the same
order as the oracle's `score_replicas` (numpy's elementwise +, -, *, / and comparisons are
exactly Python's; the routed-work decay, a `pow`, stays Python's own, see
`RoutedWorkMeter.values`), the order is (tier, score, candidate position) as its
`rank_replicas` sorts, and the cache / prefix affinity rules are those of router_policy's
docstring (the oracle's `cache_affinity_first` and `rank_replicas`). One reading is
fixed here: `cached_tokens` answers for every candidate (missing: 0), as both callers build
it, so "the pending replica is among the answers" is "it is a candidate".
tests/unit/test_router_table.py checks rank() and best() against the oracle's rank_replicas
on random situations.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic

import numpy as np

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.router_policy import (
    TIER_DRAINING,
    TIER_HOT,
    TIER_OK,
    Correction,
    R,
    effective_load,
    prefill_queue,
)
from iterserve.autoscale.signals import ReplicaLoad

# Columns of a row: what a replica's (stats, correction) pair fixes. TIER: its tier before
# this request's share and staleness (DRAINING, else HOT where hot, else OK); STALE_FROM: its
# stats' timestamp (inf without stats: never stale); KV_TOKENS: 0 where unknown.
EFF_KV, TIER, STALE_FROM, KV_TOKENS, BASE, PREFILL, PREFILL_AS_OF, PREFILL_RATE = range(8)
NUM_COLUMNS = 8
if (TIER_OK, TIER_HOT) != (0, 1) or TIER_DRAINING <= TIER_HOT:  # score()'s np.maximum
    raise ImportError("router_table's tiers assume OK = 0 < HOT = 1 < DRAINING")
_NO_CORRECTION = Correction(0)
_UNSET = object()  # a row not computed yet (no stats object is this)


class ScoreTable(Generic[R]):
    """One router's rows, one per replica it has scored (never shared between routers)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._row_of: dict[R, int] = {}
        self._rows = np.zeros((16, NUM_COLUMNS))
        # Per row, what its terms came from: with the router's own tracker, the stats
        # object (_own_loads); with given corrections, the stats and correction objects.
        # A row computed one way is _UNSET the other way.
        self._own_loads: list[object] = []
        self._given_loads: list[object] = []
        self._given_corrections: list[object] = []
        self._any_drained = False  # some row was computed from a drained Correction
        self._unknown_kv: set[int] = set()  # rows whose KV_TOKENS is 0 (no block count)
        self._stale: set[int] = set()  # rows invalidated and not computed since
        self._epoch = 0  # counts `refresh` calls: an offer refreshed in another is rescanned

    # ------------------------------------------------------------------------ rows
    def rows_for(self, candidates: Sequence[R]) -> list[int]:
        rows = list(map(self._row_of.get, candidates))
        if None in rows:
            rows = [self._add_row(rid) if row is None else row
                    for rid, row in zip(candidates, rows, strict=True)]
        return rows

    def _add_row(self, replica_id: R) -> int:
        row = self._row_of.get(replica_id)
        if row is not None:  # a candidate listed twice
            return row
        row = len(self._own_loads)
        if row == len(self._rows):
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
        self._row_of[replica_id] = row
        self._own_loads.append(_UNSET)
        self._given_loads.append(_UNSET)
        self._given_corrections.append(_UNSET)
        return row

    def invalidate(self, replica_id: R) -> None:
        """Its correction changed: recompute its row the next time it is a candidate."""
        row = self._row_of.get(replica_id)
        if row is not None:
            self._own_loads[row] = _UNSET
            self._stale.add(row)

    def forget(self, replica_id: R) -> None:
        self.invalidate(replica_id)  # its row stays allocated (a replica id is not reused)

    def refresh(self, candidates: Sequence[R], rows: Sequence[int],
                loads: Sequence[ReplicaLoad | None],
                corrections: Sequence[Correction | None] | None,
                tracker: Callable[[R, ReplicaLoad | None], Correction | None] | None = None
                ) -> None:
        """Recompute the rows whose stats object (or given correction) is not the one their
        terms came from. corrections None: each row's correction is tracker(replica, load),
        this router's own tracker, whose changes arrive through `invalidate`."""
        self._epoch += 1
        if corrections is None:
            if tracker is None:
                raise ValueError("need the corrections or a tracker to ask")
            seen = self._own_loads
            changed = map(operator.is_not, loads, map(seen.__getitem__, rows))
            for i in itertools.compress(range(len(rows)), changed):  # C-speed scan
                row, load = rows[i], loads[i]
                self._compute_own(row, load, tracker(candidates[i], load))
        else:
            seen, used = self._given_loads, self._given_corrections
            for row, load, corr in zip(rows, loads, corrections, strict=True):
                if load is not seen[row] or corr is not used[row]:
                    self._compute(row, load, corr)
                    seen[row], used[row] = load, corr
                    self._own_loads[row] = _UNSET

    def _compute_own(self, row: int, load: ReplicaLoad | None, correction: Correction | None
                     ) -> None:
        """_compute with this router's own tracker's correction: the row now follows load."""
        self._compute(row, load, correction)
        self._own_loads[row] = load
        self._given_loads[row] = _UNSET

    def _compute(self, row: int, load: ReplicaLoad | None, correction: Correction | None
                 ) -> None:
        config = self.config
        self._stale.discard(row)
        corr = _NO_CORRECTION if correction is None else correction
        # now=None: staleness is the per-request part (it depends on the request's time)
        eff_waiting, eff_kv, hot, _ = effective_load(load, corr, None, config)
        base = config.waiting_weight * eff_waiting + config.kv_weight * eff_kv
        tier = TIER_HOT if hot else TIER_OK
        if load is None:
            kv_tokens = 0
            self._rows[row] = (eff_kv, tier, np.inf, 0.0, base, corr.prefill_tokens, 0.0, 0.0)
        else:
            # rate 0 where not drained: queued_prefill is then the whole U
            queued, as_of = prefill_queue(corr, load, config)
            drained = as_of is not None
            self._any_drained |= drained
            kv_tokens = load.num_total_blocks * config.prefix_block_size
            self._rows[row] = (eff_kv, TIER_DRAINING if load.draining else tier, load.timestamp,
                               kv_tokens, base, queued, as_of if drained else 0.0,
                               load.prefill_token_rate if drained else 0.0)
        if kv_tokens > 0:
            self._unknown_kv.discard(row)
        else:
            self._unknown_kv.add(row)

    # ---------------------------------------------------------------------- offers
    def offer(self, candidates: Sequence[R]) -> OfferedRows[R]:
        return OfferedRows(list(candidates), self.rows_for(candidates))

    def refresh_offered(self, offered: OfferedRows[R], changed: Iterable[int],
                        load_at: Callable[[int], ReplicaLoad | None],
                        tracker: Callable[[R, ReplicaLoad | None], Correction | None]) -> None:
        """`refresh` with this router's own tracker, for a candidate list offered again:
        changed: the positions whose load may differ from the last time it was refreshed
        here (every other position's load is the same object); load_at(i): position i's.
        Rows invalidated since are recomputed too; an offer refreshed before another
        `refresh` ran is scanned whole."""
        seen, rows, ids = self._own_loads, offered.rows, offered.ids
        if offered.epoch != self._epoch:
            changed = range(len(rows))
        for i in changed:
            row, load = rows[i], load_at(i)
            if load is not seen[row]:
                self._compute_own(row, load, tracker(ids[i], load))
        if self._stale:
            position = offered.position_of_row
            for row in [r for r in self._stale if r in position]:
                i = position[row]
                load = load_at(i)
                self._compute_own(row, load, tracker(ids[i], load))
        offered.epoch = self._epoch

    def best_offered(self, offered: OfferedRows[R], order: Sequence[int], now: float | None,
                     request_tokens: int, prompt_tokens: int,
                     cached_tokens: Mapping[R, int] | None, work: Sequence[float] | None,
                     pending: R | None) -> R:
        """`decide(..., full=False)` for the candidates in the order `offered.ids[j] for j
        in order` (a permutation), scored in the offer's own order: the order only breaks
        ties. work: per candidate in the offer's order."""
        if not offered.ids:
            raise ValueError("no candidates")
        ids = offered.ids
        hits = self.hits(offered.ix, cached_tokens)
        tier, score, balance = self.score(offered.ix, now, request_tokens, prompt_tokens,
                                          hits, work)
        lead = _first_min(tier, score, None, order)
        preferred = self._preferred(ids, tier, score, balance, hits, prompt_tokens, pending,
                                    lead, order)
        return ids[lead if preferred is None else preferred]

    # -------------------------------------------------------------------- scoring
    def hits(self, ix: np.ndarray, cached_tokens: Mapping[R, int] | None) -> np.ndarray | None:
        """cached_tokens over the candidates' rows ix (missing: 0), or None: O(answers)."""
        if cached_tokens is None:
            return None
        by_row = np.zeros(len(self._own_loads), np.int64)
        row_of = self._row_of
        for rid, hit in cached_tokens.items():
            row = row_of.get(rid)
            if row is not None:
                by_row[row] = hit
        return by_row[ix]

    def score(self, ix: np.ndarray, now: float | None, request_tokens: int,
              prompt_tokens: int, hits: np.ndarray | None, work: Sequence[float] | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tier, score, balance) per candidate, as router_policy's docstring defines them.
        hits: cached prompt tokens per candidate (None: unknown); work: the routed-work
        meter's value per candidate (None: the meter is empty)."""
        config = self.config
        terms = self._rows[ix]
        n = len(ix)
        kv_tokens = terms[:, KV_TOKENS]
        if request_tokens <= 0:
            share = config.inflight_kv_per_request * 1
        elif not self._unknown_kv:  # every row knows its blocks
            share = request_tokens / kv_tokens
        else:
            share = np.full(n, config.inflight_kv_per_request * 1)
            np.divide(request_tokens, kv_tokens, out=share, where=kv_tokens > 0.0)
        hot = terms[:, EFF_KV] + share >= config.kv_high_watermark
        stale_from = terms[:, STALE_FROM]
        # now - t falls as t grows (IEEE subtraction is monotone), so some row is stale
        # exactly when the oldest is: usually none is, and the elementwise test is skipped
        if now is not None and len(stale_from) and \
                now - stale_from.min() > config.stats_stale_after_s:
            hot |= now - stale_from > config.stats_stale_after_s
        tier = np.maximum(terms[:, TIER], hot)  # HOT is 1: a hot OK row becomes HOT
        score = terms[:, BASE]
        best_hit = 0
        if config.score_prefill_work:
            if hits is None:
                own = float(max(0, prompt_tokens))
            else:
                own = np.maximum(0, prompt_tokens - hits)
                best_hit = int(hits.max()) if len(hits) else 0
            queued = terms[:, PREFILL]
            if now is not None and self._any_drained:  # queued_prefill's operations
                elapsed = np.maximum(0.0, now - terms[:, PREFILL_AS_OF])
                queued = np.maximum(0.0, queued - terms[:, PREFILL_RATE] * elapsed)
            score = score + (queued + own) / config.prefill_tokens_per_waiting
        elif hits is not None and len(hits):
            best_hit = int(hits.max())
        if work is None:
            balance = np.zeros(n)
        else:
            weight = config.routed_work_weight * (
                1.0 - min(1.0, best_hit / max(1, prompt_tokens)))
            values = np.asarray(work)
            least = values.min() if len(work) else 0.0
            balance = weight * (values - least) / config.prefill_tokens_per_waiting
        return tier, score + balance, balance

    def decide(self, candidates: Sequence[R], rows: Sequence[int], now: float | None,
               request_tokens: int, prompt_tokens: int, cached_tokens: Mapping[R, int] | None,
               work: Sequence[float] | None, pending: R | None, full: bool) -> list[R]:
        """The ranking (full: every candidate, best first; else only the best).
        cached_tokens: every candidate's prefix-cache answer (missing: 0), or None;
        pending: the affinity table's replica for this prompt's key (None: none)."""
        if not candidates:
            return []
        ix = np.fromiter(rows, np.intp, len(rows))
        hits = self.hits(ix, cached_tokens)
        tier, score, balance = self.score(ix, now, request_tokens, prompt_tokens, hits, work)
        order = np.lexsort((score, tier)) if full else None
        lead = int(order[0]) if full else _first_min(tier, score, None)
        preferred = self._preferred(candidates, tier, score, balance, hits, prompt_tokens,
                                    pending, lead)
        if not full:
            return [candidates[lead if preferred is None else preferred]]
        ranked = [candidates[i] for i in order.tolist()]
        if preferred is not None and preferred != lead:
            chosen = candidates[preferred]
            ranked.remove(chosen)
            ranked.insert(0, chosen)
        return ranked

    def _preferred(self, candidates: Sequence[R], tier: np.ndarray, score: np.ndarray,
                   balance: np.ndarray, hits: np.ndarray | None, prompt_tokens: int,
                   pending: R | None, lead: int, order: Sequence[int] | None = None
                   ) -> int | None:
        """The candidate that affinity moves to the front, if any (its position); order:
        as `_first_min`'s."""
        config = self.config
        if hits is not None and config.score_prefill_work:  # cache affinity over the replicas' answers
            if prompt_tokens <= 0 or config.cache_affinity_threshold > 1.0:
                return None
            best_hit = int(hits.max())
            if best_hit > 0 and best_hit / prompt_tokens >= config.cache_affinity_threshold:
                pref = _first_min(tier, score, hits == best_hit, order)
            elif pending is not None and (pref := _position(candidates, pending)) is not None:
                pass
            else:
                return None
            ok = tier[pref] == TIER_OK and (
                score[pref] - balance[pref]
                <= score[lead] - balance[lead] + config.cache_affinity_slack)
            return pref if ok else None
        if not config.prefix_affinity or pending is None:
            return None
        pref = _position(candidates, pending)
        if pref is None:
            return None
        if tier[pref] == TIER_OK and score[pref] <= score[lead] + config.prefix_affinity_slack:
            return pref
        return None


def _first_min(tier: np.ndarray, score: np.ndarray, mask: np.ndarray | None,
               order: Sequence[int] | None = None) -> int:
    """The position with the least (tier, score) (among mask's, when given) that comes
    first in order (a permutation of the positions; None: the positions' own order)."""
    if mask is not None:
        tier = np.where(mask, tier, TIER_DRAINING + 1)
    low = tier == tier.min()
    best = score[low].min()
    tied = np.flatnonzero(low & (score == best))
    if order is None or len(tied) == 1:
        return int(tied[0])
    ordered = np.fromiter(order, np.intp, len(order))
    return int(ordered[np.isin(ordered, tied)][0])


class OfferedRows(Generic[R]):
    """A candidate list a caller offers again and again (the same ids in the same order),
    with its rows in the table (`ScoreTable.offer`), and the `refresh` it was last
    brought up to date in (`ScoreTable.refresh_offered`)."""

    __slots__ = ("ids", "rows", "ix", "position_of_row", "epoch")

    def __init__(self, ids: list[R], rows: list[int]) -> None:
        self.ids = ids
        self.rows = rows
        self.ix = np.fromiter(rows, np.intp, len(rows))
        self.position_of_row = {row: i for i, row in enumerate(rows)}
        self.epoch = -1  # never refreshed


def _position(candidates: Sequence[R], replica_id: R) -> int | None:
    try:
        return candidates.index(replica_id)  # type: ignore[attr-defined]
    except ValueError:
        return None
