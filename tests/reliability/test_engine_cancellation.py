"""Cancellation at every await of AsyncLLMEngine.generate, and what a dead engine does to Serve.

Found by the Serve disconnect storm (test_disconnect_storm.py): a client that disconnects
while its request is being admitted cancels `await asyncio.wrap_future(self._submit(add))`.
asyncio.wrap_future then cancels the concurrent Future of the `add` command; the engine
thread later calls set_result on it, gets InvalidStateError, calls set_exception (which
raises InvalidStateError again), and the exception ends the engine loop: every request of
that replica fails with EngineDeadError from then on. Even without the crash, the request
that was added is never aborted (the cancellation happens before generate's try/finally),
so it runs to its end holding KV blocks with nobody listening.

Bugs B2 (replica/async_engine.py) and B3 (deploy/llm_replica.py) in RELIABILITY.md, now fixed;
these tests keep them fixed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from iterserve.replica import AsyncLLMEngine, EngineConfig, SamplingParams

ENGINE = {"model": "iterserve-tiny", "device": "cpu", "max_model_len": 128, "num_gpu_blocks_override": 32,
          "max_num_seqs": 4}


def engine_idle(engine: AsyncLLMEngine) -> dict[str, Any]:
    def read(inner: Any) -> dict[str, Any]:
        inner.block_manager.check_invariants()
        return {"requests": len(inner.scheduler.requests), "children": len(inner.children),
                "used_blocks": inner.block_manager.num_used_blocks,
                "streams": len(engine._streams)}

    return engine._submit(read).result(timeout=30)


def test_cancel_during_admission_keeps_engine_alive() -> None:
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(**ENGINE), start=False)
    try:
        async def scenario() -> None:
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

            async def consume() -> None:
                async for _ in engine.generate([1, 2, 3, 4], params, "cancelled-while-adding"):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)  # the add command is queued; the engine thread is not up
            task.cancel()  # the client disconnects while its request is being admitted
            await asyncio.gather(task, return_exceptions=True)
            engine._thread.start()
            await asyncio.sleep(0.5)
            assert engine.is_healthy, f"the engine loop died: {engine._dead!r}"
            outs = [o async for o in engine.generate([5, 6, 7], params, "after")]
            assert outs[-1].finished

        asyncio.run(asyncio.wait_for(scenario(), 60))
        deadline = time.monotonic() + 10
        state = engine_idle(engine)
        while state["requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
            state = engine_idle(engine)
        assert state == {"requests": 0, "children": 0, "used_blocks": 0, "streams": 0}, state
    finally:
        engine.shutdown()


def test_cancel_racing_admission_aborts_the_request() -> None:
    """The add command runs, but the caller is cancelled before it sees the result."""
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(**ENGINE))
    try:
        async def scenario() -> None:
            params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

            async def consume() -> None:
                async for _ in engine.generate([1, 2, 3, 4], params, "raced"):
                    pass

            # Hold the engine thread inside a command so that `add` is queued behind it and
            # the cancellation lands while the add is running or about to.
            blocker = engine._submit(lambda _: time.sleep(0.3))
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.wrap_future(blocker)
            await asyncio.sleep(0.2)

        asyncio.run(asyncio.wait_for(scenario(), 60))
        time.sleep(0.2)
        assert engine.is_healthy, f"the engine loop died: {engine._dead!r}"
        state = engine_idle(engine)
        # 100 tokens take ~2 s on this model: still running unless it was aborted
        assert state["requests"] == 0 and state["used_blocks"] == 0, state
    finally:
        engine.shutdown()


def _replica_outside_serve() -> Any:
    from iterserve.deploy.llm_replica import LLMReplica

    cls = LLMReplica.func_or_class
    replica = cls.__new__(cls)
    asyncio.run(replica.__init__(EngineConfig.from_kwargs(**ENGINE)))
    return replica


def test_replica_constructs_outside_serve() -> None:
    _replica_outside_serve().engine.shutdown()


def test_replica_health_check_fails_when_engine_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    from iterserve.deploy.llm_replica import LLMReplica

    monkeypatch.setattr(LLMReplica.func_or_class, "_current_replica_id",
                        staticmethod(lambda: "outside-serve"))
    replica = _replica_outside_serve()
    try:
        assert hasattr(replica, "check_health"), "no check_health: Serve only sees the actor"
        replica.check_health()  # healthy engine: no error
        replica.engine._dead = RuntimeError("simulated engine-loop death")
        with pytest.raises(Exception):  # noqa: B017 - any exception fails Serve's check
            replica.check_health()
    finally:
        replica.engine.shutdown()
