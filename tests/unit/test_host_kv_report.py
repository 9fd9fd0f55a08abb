"""The engine reports its host KV tier's blocks to routers: a prefix the device evicted into
the host tier is listed under "host" in `cached_block_hashes()` (tiny model, CPU)."""

from __future__ import annotations

from block_hash_oracle import prompt_block_hashes
from test_host_kv_engine import BLOCK, DEVICE_BLOCKS, GREEDY, TIER_GIB, conversations

from iterserve.replica import EngineConfig, LLMEngine
from iterserve.replica.make_model import default_model_path


def test_evicted_prefixes_are_reported_in_the_host_tier() -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(default_model_path()), num_gpu_blocks_override=DEVICE_BLOCKS,
        block_size=BLOCK, kv_offloading_size=TIER_GIB, cpu_decode_attention="loop"))
    first, *others = conversations()
    for prompt in (first, *others):  # the others evict the first's blocks from the device
        engine.add_request(prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    report = engine.cached_block_hashes()
    chain = prompt_block_hashes(first, BLOCK)
    assert set(chain) <= set(report["host"]) and not set(chain) & set(report["device"])
    assert set(prompt_block_hashes(others[-1], BLOCK)) <= set(report["device"])
