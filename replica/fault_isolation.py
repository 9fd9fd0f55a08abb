"""Running a batch so that one request's fault fails that request alone.

A batched operation that raises on one request's inputs would otherwise take the whole step
(and, before issue 10, the engine loop) with it. The batch runs once as a batch; only when it
raises is it rerun request by request, to find the requests it choked on. Device faults
(`is_device_fault`: CUDA errors, out of memory) are never isolated: they stop the loop.
"""

from __future__ import annotations

import logging

from iterserve.replica.errors import is_device_fault
from iterserve.replica.outputs import RunnerOutput, SchedulerOutput
from iterserve.replica.runner_base import Runner

logger = logging.getLogger(__name__)


def execute_isolating_faults(runner: Runner, scheduler_output: SchedulerOutput) -> RunnerOutput:
    """Run the batch; if a batched operation raises, run each request alone and fail only the
    requests whose inputs it choked on (`RunnerOutput.failed`)."""
    try:
        return runner.execute(scheduler_output)
    except Exception as error:  # noqa: BLE001 - a device fault is re-raised
        if is_device_fault(error):
            raise
        logger.warning("a batched step raised %r; running its requests one by one", error)
        return execute_one_by_one(runner, scheduler_output)


def execute_one_by_one(runner: Runner, scheduler_output: SchedulerOutput) -> RunnerOutput:
    """Each scheduled request in a batch of its own; the failures, by request id, in `failed`."""
    merged = RunnerOutput()
    for scheduled in scheduler_output.scheduled:
        if scheduled.is_padding:
            continue
        alone = SchedulerOutput(scheduled=[scheduled], num_batched_tokens=scheduled.num_new_tokens)
        try:
            merged.merge(runner.execute(alone))
        except Exception as error:  # noqa: BLE001 - this request's failure; device faults raise
            if is_device_fault(error):
                raise
            merged.failed[scheduled.request.request_id] = f"{type(error).__name__}: {error}"
    return merged
