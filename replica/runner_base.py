"""The one interface between the scheduler's world and the device's.

Two implementations: `ModelRunner` (real weights, real kernels) and `SimulatedRunner`
(a calibrated cost model that sleeps and emits seeded tokens). Everything above a runner —
scheduler, block manager, engines, replica, router, autoscaler, HTTP — is the same code.
"""

from __future__ import annotations

from typing import Protocol

from iterserve.replica.outputs import RunnerOutput, SchedulerOutput


class Runner(Protocol):
    vocab_size: int

    def num_kv_blocks(self) -> int:
        """How many KV blocks fit the memory budget (after any profiling pass)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens and sample one token for each request that samples.

        Sampling state (per-request seeded generators, penalties) lives in the runner; the
        runner drops a request's state when `release(request_id)` is called.
        """
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's sampling state (a preempted one keeps it)."""
        ...
