"""SIGTERM while an event loop runs: Terminated comes out of the awaited call, and no task
is left ending with it (asyncio would print "Task exception was never retrieved" and a
traceback, which `iterserve bench` stopped by SIGTERM once printed)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from iterserve.loadtests.servers import Terminated, terminate_as_interrupt, until_terminated


async def busy_then_signalled(tasks: list[asyncio.Task]) -> None:
    """A sampler-like task that is running (not waiting) when the signal arrives."""

    async def sampler() -> None:
        while True:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered while this task's code runs
            sum(range(100_000))
            await asyncio.sleep(0.01)

    task = asyncio.create_task(sampler())
    tasks.append(task)
    try:
        await asyncio.sleep(5)
    finally:
        task.cancel()


def test_sigterm_in_a_running_task_comes_out_as_terminated(
        capsys: pytest.CaptureFixture[str]) -> None:
    tasks: list[asyncio.Task] = []

    async def watched() -> None:
        await until_terminated(busy_then_signalled(tasks))

    before = signal.getsignal(signal.SIGTERM)
    with terminate_as_interrupt(), pytest.raises(Terminated) as stop:
        asyncio.run(watched())
    assert stop.value.signum == signal.SIGTERM
    assert tasks[0].cancelled()  # not ended by the exception, which nobody would retrieve
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored
    assert "Traceback" not in capsys.readouterr().err
