"""The one interface between the scheduler's world and the device's.

Two implementations: `ModelRunner` (real weights, real kernels) and `SimulatedRunner`
(a calibrated cost model that sleeps and emits seeded tokens). Everything above a runner —
scheduler, block manager, engines, replica, router, autoscaler, HTTP — is the same code.

A step runs either at once (`execute`) or in two halves (`launch`, then `result()` on the
handle) so that the engine can plan the next step while the device computes this one (async
scheduling). Steps run in launch order, like kernels on one CUDA stream: a decode input whose
token the previous step is still sampling is filled in by the runner from that step's
output, so it can be launched before that output reaches the host.
"""

from __future__ import annotations

from typing import Protocol

from iterserve.replica.outputs import RunnerOutput, SchedulerOutput


class StepHandle(Protocol):
    def result(self) -> RunnerOutput:
        """Wait until the step's sampled tokens are on the host and return them."""
        ...


class CompletedStep:
    """A step that finished when it was launched (CPU execution, or nothing to compute)."""

    def __init__(self, output: RunnerOutput) -> None:
        self._output = output

    def result(self) -> RunnerOutput:
        return self._output


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

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Start the step and return without waiting for it (same contract as execute)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's sampling state (a preempted one keeps it)."""
        ...
