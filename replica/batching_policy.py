"""How batches form: continuous (admit whenever there is room) or static (batch by batch).

The scheduler asks its batching strategy, chosen once at construction:

    admission_open(num_running)     may waiting requests be admitted this step at all
    start_admission(waiting)        called before admitting (static batching picks its batch)
    admits(request)                 may this waiting request join now
    admitted(count)                 how many joined this step
    retire(request, status)         a request finished: True if its blocks stay held
    release_padding()               give held blocks back early; True if any were held
    schedule_padding(output, ...)   add this step's padding rows to the plan

Continuous batching admits every step, or under an admission window (wait until
`admission_min_free_slots` slots are free or `admission_max_wait_ms` has passed).
Static batching admits a batch only when nothing is running and never admits mid-batch. As
in HF `generate` and FasterTransformer, the batch keeps its shape until its longest request
finishes: a finished row keeps its slot and KV blocks and is computed as a padding row (one
token a step, output discarded) until the batch ends (`static_batch_padding=False` lets
finished rows leave at once). Padding rows give their blocks back early only if a live
request of the batch would otherwise be preempted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.outputs import ScheduledRequest, SchedulerOutput
from iterserve.replica.request import Request, RequestStatus


class ContinuousBatching:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.min_free_slots = config.admission_min_free_slots
        self.max_wait_ms = config.admission_max_wait_ms
        self.clock = clock
        self._last_admission = clock()

    def admission_open(self, num_running: int) -> bool:
        if self.min_free_slots == 0 and self.max_wait_ms == 0:
            return True
        if self.min_free_slots and self.max_num_seqs - num_running >= self.min_free_slots:
            return True
        waited_ms = (self.clock() - self._last_admission) * 1000.0
        return self.max_wait_ms > 0 and waited_ms >= self.max_wait_ms

    def start_admission(self, waiting: Iterable[Request], num_running: int) -> None:
        return None

    def admits(self, request: Request) -> bool:
        return True

    def admitted(self, count: int) -> None:
        if count:
            self._last_admission = self.clock()

    def retire(self, request: Request, status: RequestStatus) -> bool:
        return False

    def release_padding(self) -> bool:
        return False

    def schedule_padding(self, output: SchedulerOutput, budget: int) -> int:
        return budget


class StaticBatching(ContinuousBatching):
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float],
                 blocks: BlockManager) -> None:
        super().__init__(config, clock)
        self.pads = config.static_batch_padding
        self.blocks = blocks
        self.batch: set[str] = set()  # live requests of the batch being served
        self.padding_rows: list[Request] = []  # finished rows of that batch, still holding KV

    def admission_open(self, num_running: int) -> bool:
        return num_running == 0 or bool(self.batch)

    def start_admission(self, waiting: Iterable[Request], num_running: int) -> None:
        if num_running == 0 and not self.batch:
            self.batch = {r.request_id for r in itertools.islice(waiting, self.max_num_seqs)}

    def admits(self, request: Request) -> bool:
        return request.request_id in self.batch

    def retire(self, request: Request, status: RequestStatus) -> bool:
        in_batch = request.request_id in self.batch
        self.batch.discard(request.request_id)
        keeps = (in_batch and self.pads and request.num_computed_tokens > 0
                 and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH))
        if keeps:
            self.padding_rows.append(request)
        if not self.batch:
            self.release_padding()
        return keeps

    def release_padding(self) -> bool:
        """Padding is worth less than a live request: free its blocks."""
        had_rows = bool(self.padding_rows)
        for row in self.padding_rows:
            self.blocks.free(row)
        self.padding_rows.clear()
        return had_rows

    def schedule_padding(self, output: SchedulerOutput, budget: int) -> int:
        """Each finished row recomputes its last position, so the batch keeps its shape."""
        for row in self.padding_rows:
            if budget == 0 or len(output.scheduled) >= self.max_num_seqs:
                break
            output.scheduled.append(ScheduledRequest(
                request=row,
                num_computed_tokens=row.num_computed_tokens - 1,
                num_new_tokens=1,
                block_table=self.blocks.block_table(row.request_id),
                is_padding=True,
                samples=False,
            ))
            budget -= 1
        return budget


def make_batching(config: SchedulerConfig, clock: Callable[[], float],
                  blocks: BlockManager) -> ContinuousBatching:
    if config.batching == "static":
        return StaticBatching(config, clock, blocks)
    return ContinuousBatching(config, clock)
