"""LLMReplica.record_routing_stats outside Serve (simulated runner): its prefix cache's block
hashes travel with its load; the autoscaling metrics stay numbers only."""

from __future__ import annotations

import asyncio

import pytest
from block_hash_oracle import prompt_block_hashes

from iterserve.autoscale.signals import AUTOSCALING_METRICS, ReplicaLoad
from iterserve.replica.config import EngineConfig
from iterserve.replica.sampling_params import SamplingParams

# LLMReplica's graceful shutdown is an async __del__: never awaited outside Serve
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'LLMReplica.__del__'")


def test_routing_stats_carry_the_cached_block_hashes() -> None:
    from iterserve.deploy.llm_replica import LLMReplica

    async def run() -> tuple[dict, dict, dict, list[int]]:
        cls = LLMReplica.func_or_class
        replica = cls.__new__(cls)
        await replica.__init__(EngineConfig.from_kwargs(runner="simulated", max_model_len=512))
        prompt = list(range(10, 100))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in replica.generate(prompt, params, "a"):
            pass
        stats = await replica.record_routing_stats()
        metrics = replica.record_autoscaling_stats()
        replica.engine.shutdown()
        dead = await replica.record_routing_stats()  # a stopped engine reports no cache
        return stats, metrics, dead, prompt_block_hashes(prompt, 16)

    stats, metrics, dead, chain = asyncio.run(run())
    load = ReplicaLoad.from_dict(stats)
    assert load.block_size == 16 and set(chain) <= load.cached_block_hashes
    assert set(metrics) == set(AUTOSCALING_METRICS)
    assert all(isinstance(v, float) for v in metrics.values())
    assert "cached_block_hashes" not in dead and ReplicaLoad.from_dict(dead).draining
