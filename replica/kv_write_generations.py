"""Per KV block (or host-tier slot): a count of the writes planned into it, so that another
thread may copy cached blocks out without waiting for the engine's step boundary, and know
afterwards whether what it copied is what the block held (a seqlock's reader side).

The engine thread alone writes: it opens a write (`open`: the count turns odd) when it plans
anything that will change the block's bytes (a device block leaving the prefix cache for new
tokens, a host-tier block copied into it, a host slot given to another block), before the
bytes can change, and closes the step's writes (`close`: even again) once the step that ran
the copies and the forward has finished. A reader (`export_blocks_unlocked`,
replica/kv_transfer.py) reads the count, checks the block is still the one its key names,
copies, and reads the count again: the copy is the block's only if the count was even and
did not move. Python's GIL orders the counts' reads and writes between the two threads; the
bytes themselves are written only after their count moved (program order on the engine
thread), so a write that overlapped the copy always shows in the second read.
"""

from __future__ import annotations


class WriteGenerations:
    def __init__(self, size: int) -> None:
        self._counts = [0] * size
        self._opened: list[int] = []  # odd since the last take_opened

    def open(self, index: int) -> None:
        """A write into `index` is planned (its bytes may change from now until closed)."""
        if self._counts[index] % 2 == 0:
            self._counts[index] += 1
            self._opened.append(index)

    def take_opened(self) -> list[int]:
        """The writes opened since the last call, handed to the step that runs them."""
        opened, self._opened = self._opened, []
        return opened

    def close(self, indices: list[int]) -> None:
        """The step that ran these writes has finished: their bytes are final again."""
        counts = self._counts
        for index in indices:
            if counts[index] % 2 == 1:
                counts[index] += 1

    def stable(self, index: int) -> int | None:
        """The count while no write is open into `index`, else None (from any thread)."""
        count = self._counts[index]
        return None if count % 2 else count

    def unchanged(self, index: int, count: int) -> bool:
        """Whether `index` saw no write planned since `count` was read (from any thread)."""
        return self._counts[index] == count
