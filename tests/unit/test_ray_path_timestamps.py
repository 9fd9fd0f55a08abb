"""The timestamps the Ray-path latency split reads (issue 12: simulator vs Ray Serve)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from iterserve.loadtests.studies.ray_harness import ClientRecord, hop_summary
from iterserve.replica import AsyncLLMEngine, EngineConfig, SamplingParams

# One prefill step of a 1500-token prompt at time_scale 20: (6.5 ms + 1500 x 30 us) x 20
# ~ 1 s, so a request sent 0.2 s into it waits ~0.8 s for the engine thread.
SLOW = {"runner": "simulated", "max_model_len": 2048, "num_gpu_blocks_override": 256,
        "max_num_seqs": 8, "simulator": json.dumps({"time_scale": 20.0})}


def test_arrival_is_the_call_not_the_end_of_the_busy_step() -> None:
    async def main() -> tuple[float, float, float]:
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(**SLOW))
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        try:
            busy = asyncio.ensure_future(
                _first(engine.generate(list(range(5, 1505)), params, "busy")))
            await asyncio.sleep(0.2)  # the busy prefill step is running
            called = time.monotonic()
            out = await _first(engine.generate([7, 8, 9], params, "late"))
            await busy
        finally:
            engine.shutdown()
        return called, out.arrival_time, out.first_token_time

    called, arrival, first = asyncio.run(main())
    assert arrival == pytest.approx(called, abs=0.05)
    assert first - arrival > 0.5  # the wait for the busy step counts in the engine's TTFT


async def _first(stream):  # noqa: ANN001, ANN202 - an async generator of RequestOutput
    async for out in stream:
        if out.new_token_ids:
            await stream.aclose()
            return out
    raise AssertionError("no token")


def test_hop_summary_splits_driver_ttft_around_the_engine() -> None:
    records = []
    for i in range(10):
        r = ClientRecord(f"r{i}", sent=100.0 + i, kind="short", prompt_tokens=100,
                          first_token=100.0 + i + 0.5, finish_reason="length",
                          engine_arrival=100.0 + i + 0.01 * (i + 1),
                          engine_first_token=100.0 + i + 0.49, cached_tokens=50)
        records.append(r)
    records.append(ClientRecord("failed", 0.0, "short", error="boom"))
    s = hop_summary(records)
    assert s["hops_measured"] == 10
    assert s["dispatch_p50_s"] == pytest.approx(0.055)
    assert s["return_p50_s"] == pytest.approx(0.01)
    assert s["engine_ttft_p50_s"] == pytest.approx(0.435)
    assert s["prefix_hit_rate"] == pytest.approx(0.5)
