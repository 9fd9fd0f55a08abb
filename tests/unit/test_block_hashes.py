"""Stable prefix-cache block hashes: the same in every process, and the block manager's
report of them (what a replica sends the router with its routing stats)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from iterserve.replica.block_hashes import (
    CachedBlockHashes,
    leading_run,
    prompt_block_hashes,
    stable_block_hash,
)
from iterserve.replica.block_manager import BlockManager, block_tokens
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams

BLOCK = 4
PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks a lookup could hit

# Run in a fresh interpreter: a block manager's report for PROMPT, and PROMPT's chain.
_CHILD = """
import json
from iterserve.replica.block_hashes import CachedBlockHashes, prompt_block_hashes
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
manager = BlockManager(8, 4, enable_prefix_caching=True)
request = Request("a", list(range(1, 14)), SamplingParams(max_tokens=1), 0.0)
manager.allocate(request, 13)
request.num_computed_tokens = 13
manager.mark_computed(request)
manager.free(request)
print(json.dumps({"chain": prompt_block_hashes(list(range(1, 14)), 4),
                  "report": sorted(CachedBlockHashes().report(manager.cached_blocks)),
                  "salted": hash(b"salted")}))
"""


def _child(seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, check=True, timeout=120)
    return json.loads(done.stdout)


def run_and_free(manager: BlockManager, rid: str, prompt: list[int]) -> None:
    """A request that computed its whole prompt, then finished: its full blocks stay cached."""
    request = Request(rid, prompt, SamplingParams(max_tokens=1), 0.0)
    manager.allocate(request, len(prompt), manager.find_cached_prefix(request))
    request.num_computed_tokens = len(prompt)
    manager.mark_computed(request)
    manager.free(request)


def test_the_chain_is_the_same_in_processes_with_different_hash_seeds() -> None:
    one, two = _child("1"), _child("2")
    assert one["salted"] != two["salted"]  # Python's own hash differs: the keys would
    assert one["chain"] == two["chain"] == prompt_block_hashes(PROMPT, BLOCK)
    assert one["report"] == two["report"] == sorted(prompt_block_hashes(PROMPT, BLOCK))


def test_the_chain_names_the_whole_prefix() -> None:
    chain = prompt_block_hashes(PROMPT, BLOCK)
    assert len(chain) == 3 and len(set(chain)) == 3
    other = prompt_block_hashes([99] + PROMPT[1:], BLOCK)  # first block differs
    assert not set(chain) & set(other)  # so every later block's hash differs too
    same_head = prompt_block_hashes(PROMPT[:8] + [77] * 5, BLOCK)
    assert same_head[:2] == chain[:2] and same_head[2] != chain[2]
    assert leading_run(chain, frozenset(same_head)) == 2
    assert leading_run(chain, frozenset(chain[1:])) == 0  # no head: nothing to hit
    # the last token is never in a hashed block: a 12-token prompt hashes 2 blocks
    assert prompt_block_hashes(PROMPT[:12], BLOCK) == chain[:2]
    assert stable_block_hash(0, block_tokens([2**70])) != stable_block_hash(0, block_tokens([1]))
    with pytest.raises(ValueError):
        prompt_block_hashes(PROMPT, 0)


def test_report_after_a_request_ran_and_after_eviction() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True)
    report = CachedBlockHashes()
    assert report.report(manager.cached_blocks) == []
    run_and_free(manager, "a", PROMPT)  # 13 tokens: 4 blocks held, 3 full ones cached
    chain = prompt_block_hashes(PROMPT, BLOCK)
    assert sorted(report.report(manager.cached_blocks)) == sorted(chain)
    assert report.num_hashed == 3
    # a steady-state report hashes nothing new
    assert sorted(report.report(manager.cached_blocks)) == sorted(chain)
    assert report.num_hashed == 3
    # a request needing 6 blocks takes the 5 uncached ones and evicts one cached block: the
    # tail of the chain (freed first), so the head two are still reported
    big = Request("b", [500] * 21, SamplingParams(max_tokens=1), 0.0)
    manager.allocate(big, 21)
    assert sorted(report.report(manager.cached_blocks)) == sorted(chain[:2])
    assert len(report) == 2  # the memo keeps only keys still cached
    manager.free(big)  # never computed: nothing of it was cached
    everything = Request("c", [600] * 32, SamplingParams(max_tokens=1), 0.0)
    manager.allocate(everything, 32)  # all 8 blocks: the whole cache is evicted
    assert report.report(manager.cached_blocks) == [] and len(report) == 0


def test_blocks_whose_chain_lost_a_block_are_not_reported() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True)
    run_and_free(manager, "a", PROMPT)
    chain = prompt_block_hashes(PROMPT, BLOCK)
    head = next(key for key in manager.cached_blocks if key[0] == 0)
    report = CachedBlockHashes()
    without_head = {k: v for k, v in manager.cached_blocks.items() if k != head}
    assert report.report(without_head) == []  # unreachable: a lookup starts at the head
    assert sorted(report.report(manager.cached_blocks)) == sorted(chain)  # back again
    hashed = report.num_hashed
    assert report.report(without_head) == [] and report.num_hashed == hashed


def test_a_report_over_the_limit_keeps_the_shallowest_blocks() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    run_and_free(manager, "a", PROMPT)
    other = [50 + t for t in PROMPT]
    run_and_free(manager, "b", other)
    kept = CachedBlockHashes(limit=4).report(manager.cached_blocks)
    heads = prompt_block_hashes(PROMPT, BLOCK)[:2] + prompt_block_hashes(other, BLOCK)[:2]
    assert sorted(kept) == sorted(heads)


def test_a_shared_prefix_is_hit_and_reported_once() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    run_and_free(manager, "a", PROMPT)
    longer = PROMPT[:12] + [90] * 9  # shares 3 blocks, adds 2 more full ones
    run_and_free(manager, "b", longer)
    reported = CachedBlockHashes().report(manager.cached_blocks)
    assert sorted(reported) == sorted(prompt_block_hashes(longer, BLOCK))


def test_the_async_engine_reports_a_finished_prompts_blocks() -> None:
    from iterserve.replica.async_engine import AsyncLLMEngine
    from iterserve.replica.config import EngineConfig

    async def run() -> tuple[list[int] | None, list[int] | None, list[int]]:
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(
            runner="simulated", max_model_len=512, enable_prefix_caching=True))
        try:
            before = await engine.cached_block_hashes()
            prompt = list(range(10, 10 + 5 * engine.config.cache.block_size + 3))
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(prompt, params, "a"):
                pass
            after = await engine.cached_block_hashes()
            return before, after, prompt_block_hashes(prompt, engine.config.cache.block_size)
        finally:
            engine.shutdown()

    before, after, chain = asyncio.run(run())
    assert before == [] and set(chain) <= set(after)
    assert len(chain) == 5


def _brute_force_report(cached: dict) -> list[int]:
    """Every cached key whose chain reaches the root, hashed from the root up."""
    by_id = {hash(key): key for key in cached}
    out = []
    for key in cached:
        chain = [key]
        while chain[-1][0] != 0 and chain[-1][0] in by_id and len(chain) <= len(cached):
            chain.append(by_id[chain[-1][0]])
        if chain[-1][0] != 0:
            continue  # an ancestor is gone: unreachable
        stable = 0
        for link in reversed(chain):
            stable = stable_block_hash(stable, link[1])
        out.append(stable)
    return sorted(out)


def test_the_memoised_report_matches_hashing_everything_again() -> None:
    import random

    rng = random.Random(5)
    manager = BlockManager(24, BLOCK, enable_prefix_caching=True)
    report = CachedBlockHashes()
    heads = [[rng.randrange(1, 50) for _ in range(2 * BLOCK)] for _ in range(3)]
    for step in range(300):
        prompt = rng.choice(heads)[: rng.randrange(1, 2 * BLOCK + 1)]
        prompt = prompt + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 4 * BLOCK))]
        run_and_free(manager, f"r{step}", prompt)
        cached = dict(manager.cached_blocks)
        if step % 7 == 0 and cached:  # a chain loses a block in its middle, as if evicted
            del cached[rng.choice(list(cached))]
        assert sorted(report.report(cached)) == _brute_force_report(cached), step
        assert len(report) <= len(cached)
