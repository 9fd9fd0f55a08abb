"""What one router remembers of the prefill work it sent each replica (plain data, no clock:
times are passed in): prefill tokens sent, decayed exponentially, the long-run balance that
Ray's and SGLang's "smallest tree" rule keeps (forgetting slowly). It sees only this
router's own sends; `rank_replicas` weighs it in (`routed_work`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

R = TypeVar("R", bound=Hashable)


class RoutedWorkMeter(Generic[R]):
    """Prefill tokens this router sent each replica, decayed exponentially (no clock: times
    are passed in). A replica that joins starts at 0 and is compared with the least-sent
    one, so it takes extra work only until it catches up, never a flood."""

    def __init__(self, half_life_s: float) -> None:
        self._half_life_s = half_life_s
        self._tokens: dict[R, tuple[float, float]] = {}  # replica -> (tokens, as of time)

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        tokens, at = entry
        return tokens * 0.5 ** (max(0.0, now - at) / self._half_life_s)

    def add(self, replica_id: R, tokens: int, now: float) -> None:
        entry = self._tokens.get(replica_id)
        base = 0.0 if entry is None else self._decayed(entry, now)
        self._tokens[replica_id] = (base + tokens, now)

    def values(self, replica_ids: Sequence[R], now: float) -> list[float]:
        """`snapshot(now).get(r, 0.0)` for each replica, without the snapshot: the same
        float operations as `_decayed` (max(0.0, d) is `d if d > 0.0 else 0.0`)."""
        get, half_life = self._tokens.get, self._half_life_s
        return [0.0 if (e := get(r)) is None else
                e[0] * 0.5 ** ((d if (d := now - e[1]) > 0.0 else 0.0) / half_life)
                for r in replica_ids]

    def __len__(self) -> int:
        return len(self._tokens)

    def snapshot(self, now: float) -> dict[R, float]:
        return {rid: self._decayed(e, now) for rid, e in self._tokens.items()}

    def forget_replica(self, replica_id: R) -> None:
        self._tokens.pop(replica_id, None)
