"""What one router remembers of the prefill work it sent each replica (plain data, no clock:
times are passed in): prefill tokens sent, decayed exponentially, the long-run balance that
Ray's and SGLang's "smallest tree" rule keeps (forgetting slowly). It sees only this
router's own sends; the router's score weighs it in (router_policy: `sent`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np

R = TypeVar("R", bound=Hashable)


class RoutedWorkMeter(Generic[R]):
    """Prefill tokens this router sent each replica, decayed exponentially (no clock: times
    are passed in). A replica that joins starts at 0 and is compared with the least-sent
    one, so it takes extra work only until it catches up, never a flood."""

    # From this many replicas asked at once, `values` works on arrays (below it, a list
    # comprehension is cheaper than the array calls' fixed cost).
    ARRAYS_FROM = 128

    def __init__(self, half_life_s: float) -> None:
        self._half_life_s = half_life_s
        self._tokens: dict[R, tuple[float, float]] = {}  # replica -> (tokens, as of time)
        # The same entries as arrays: replica -> slot; slot 0 is "never sent" (0 tokens).
        self._slot: dict[R, int] = {}
        self.slots_version = 0  # changes whenever a replica's slot does (see `slots`)
        self._next_slot = 1
        self._slot_tokens = np.zeros(16)
        self._slot_at = np.zeros(16)

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        tokens, at = entry
        return tokens * 0.5 ** (max(0.0, now - at) / self._half_life_s)

    def add(self, replica_id: R, tokens: int, now: float) -> None:
        entry = self._tokens.get(replica_id)
        base = 0.0 if entry is None else self._decayed(entry, now)
        self._tokens[replica_id] = (base + tokens, now)
        slot = self._slot.get(replica_id)
        if slot is None:
            slot = self._slot[replica_id] = self._next_slot
            self._next_slot += 1
            self.slots_version += 1
            if slot == len(self._slot_tokens):
                self._slot_tokens = np.concatenate([self._slot_tokens, np.zeros(slot)])
                self._slot_at = np.concatenate([self._slot_at, np.zeros(slot)])
        self._slot_tokens[slot], self._slot_at[slot] = base + tokens, now

    def values(self, replica_ids: Sequence[R], now: float) -> Sequence[float]:
        """`snapshot(now).get(r, 0.0)` for each replica, without the snapshot: the same
        float operations as `_decayed` (max(0.0, d) is `d if d > 0.0 else 0.0`; the pow is
        Python's, the C library's, not numpy's, which may differ in the last bit: math.pow
        on arrays, the same libm call as `**` on floats)."""
        if len(replica_ids) >= self.ARRAYS_FROM:
            return self._values_as_array(replica_ids, now)
        get, half_life = self._tokens.get, self._half_life_s
        return [0.0 if (e := get(r)) is None else
                e[0] * 0.5 ** ((d if (d := now - e[1]) > 0.0 else 0.0) / half_life)
                for r in replica_ids]

    def slots(self, replica_ids: Sequence[R]) -> np.ndarray:
        """The replicas' slots, for `values_at`: valid while `slots_version` is unchanged."""
        n = len(replica_ids)
        return np.fromiter(map(self._slot.get, replica_ids, itertools.repeat(0)), np.intp, n)

    def values_at(self, slots: np.ndarray, now: float) -> np.ndarray:
        """`values` of the replicas whose `slots` these are (an array at any count)."""
        elapsed = np.maximum(now - self._slot_at[slots], 0.0)  # as max(0.0, d), to the bit
        exponents = (elapsed / self._half_life_s).tolist()
        decay = np.fromiter(map(math.pow, itertools.repeat(0.5), exponents), np.float64,
                            len(slots))
        return self._slot_tokens[slots] * decay  # a never-sent slot: 0.0 * decay == 0.0

    def _values_as_array(self, replica_ids: Sequence[R], now: float) -> np.ndarray:
        return self.values_at(self.slots(replica_ids), now)

    def __len__(self) -> int:
        return len(self._tokens)

    def snapshot(self, now: float) -> dict[R, float]:
        return {rid: self._decayed(e, now) for rid, e in self._tokens.items()}

    def forget_replica(self, replica_id: R) -> None:
        self._tokens.pop(replica_id, None)
        slot = self._slot.pop(replica_id, None)
        if slot is not None:  # its slot is not reused: a replica id that comes back gets a new one
            self.slots_version += 1
            self._slot_tokens[slot] = 0.0
