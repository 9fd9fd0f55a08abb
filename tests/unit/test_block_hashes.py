"""Stable prefix-cache block hashes: the same in every process, and the block manager's
report of them (what a replica sends the router with its routing stats)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from block_hash_oracle import leading_run, prompt_block_hashes

from iterserve.replica.block_hashes import BlockHashIndex, stable_block_hash
from iterserve.replica.block_keys import (
    ROOT_HASH,
    BlockHash,
    BlockTokens,
    block_hash,
    block_tokens,
)
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams

BLOCK = 4
PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks a lookup could hit

# Run in a fresh interpreter: a block manager's report for PROMPT, and PROMPT's chain.
TESTS = Path(__file__).resolve().parents[1]  # where the oracle module is
_CHILD = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n" + """
import json
from block_hash_oracle import prompt_block_hashes
from iterserve.replica.block_hashes import BlockHashIndex
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
manager = BlockManager(8, 4, enable_prefix_caching=True)
index = manager.cache_listener = BlockHashIndex()
request = Request("a", list(range(1, 14)), SamplingParams(max_tokens=1), 0.0)
manager.allocate(request, 13)
request.num_computed_tokens = 13
manager.mark_computed(request)
manager.free(request)
print(json.dumps({"chain": prompt_block_hashes(list(range(1, 14)), 4),
                  "report": sorted(index.report()["device"]),
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


def test_the_block_manager_caches_each_block_under_its_chain_hash() -> None:
    """One int per cached block, block_hash(parent's hash, tokens) from ROOT_HASH: the keys
    the router-side PromptBlockKeys builds and the stable index is told about."""
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True)
    told = []
    manager.cache_listener = type("Told", (), {
        "stored": lambda self, block, parent, tokens: told.append((block, parent, tokens)),
        "evicted": lambda self, block: None})()
    run_and_free(manager, "a", PROMPT)
    want, parent = [], ROOT_HASH
    for i in range(3):
        tokens = block_tokens(PROMPT[i * BLOCK:(i + 1) * BLOCK])
        want.append((block_hash(parent, tokens), parent, tokens))
        parent = want[-1][0]
    assert told == want
    assert sorted(manager.cached_blocks) == sorted(block for block, _, _ in want)
    assert all(type(key) is int for key in manager.cached_blocks)
    again = Request("b", PROMPT, SamplingParams(max_tokens=1), 0.0)
    assert manager.find_cached_prefix(again) == [manager.cached_blocks[b] for b, _, _ in want]


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


def indexed(num_blocks: int, limit: int = 32768) -> tuple[BlockManager, BlockHashIndex]:
    manager = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True)
    index = manager.cache_listener = BlockHashIndex(limit)
    return manager, index


def test_report_after_a_request_ran_and_after_eviction() -> None:
    manager, index = indexed(8)
    assert index.report()["device"] == []
    run_and_free(manager, "a", PROMPT)  # 13 tokens: 4 blocks held, 3 full ones cached
    chain = prompt_block_hashes(PROMPT, BLOCK)
    assert sorted(index.report()["device"]) == sorted(chain)
    assert index.num_hashed == 3
    run_and_free(manager, "again", PROMPT)  # all hits: nothing new cached, nothing hashed
    assert sorted(index.report()["device"]) == sorted(chain) and index.num_hashed == 3
    # a request needing 6 blocks takes the 5 uncached ones and evicts one cached block: the
    # tail of the chain (freed first), so the head two are still reported
    big = Request("b", [500] * 21, SamplingParams(max_tokens=1), 0.0)
    manager.allocate(big, 21)
    assert sorted(index.report()["device"]) == sorted(chain[:2]) and len(index) == 2
    manager.free(big)  # never computed: nothing of it was cached
    everything = Request("c", [600] * 32, SamplingParams(max_tokens=1), 0.0)
    manager.allocate(everything, 32)  # all 8 blocks: the whole cache is evicted
    assert index.report()["device"] == [] and len(index) == 0


def test_a_block_whose_parent_is_not_indexed_is_left_out() -> None:
    manager, index = indexed(8)
    chain = prompt_block_hashes(PROMPT, BLOCK)
    blocks = []  # (block, parent, tokens) as the block manager tells them
    parent = ROOT_HASH
    for i in range(3):
        tokens = block_tokens(PROMPT[i * BLOCK:(i + 1) * BLOCK])
        blocks.append((block_hash(parent, tokens), parent, tokens))
        parent = blocks[-1][0]
    index.stored(*blocks[1])  # its parent was never stored: unreachable, and so its child
    index.stored(*blocks[2])
    assert index.report()["device"] == [] and index.num_hashed == 0
    for block in blocks:
        index.stored(*block)
    assert sorted(index.report()["device"]) == sorted(chain)
    index.evicted(blocks[0][0])  # the head leaves: the others stay until evicted themselves
    assert sorted(index.report()["device"]) == sorted(chain[1:])
    assert leading_run(chain, frozenset(index.report()["device"])) == 0  # and no prompt counts them


def test_a_report_over_the_limit_keeps_the_shallowest_blocks() -> None:
    manager, index = indexed(16, limit=4)
    run_and_free(manager, "a", PROMPT)
    other = [50 + t for t in PROMPT]
    run_and_free(manager, "b", other)
    heads = prompt_block_hashes(PROMPT, BLOCK)[:2] + prompt_block_hashes(other, BLOCK)[:2]
    assert sorted(index.report()["device"]) == sorted(heads)


def test_a_shared_prefix_is_hit_and_reported_once() -> None:
    manager, index = indexed(16)
    run_and_free(manager, "a", PROMPT)
    longer = PROMPT[:12] + [90] * 9  # shares 3 blocks, adds 2 more full ones
    run_and_free(manager, "b", longer)
    assert sorted(index.report()["device"]) == sorted(prompt_block_hashes(longer, BLOCK))
    assert index.num_hashed == 5


def test_the_async_engine_reports_a_finished_prompts_blocks() -> None:
    from iterserve.replica.async_engine import AsyncLLMEngine
    from iterserve.replica.config import EngineConfig

    async def run() -> tuple[dict | None, dict | None, list[int]]:
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
    assert before == {"device": []} and set(chain) <= set(after["device"])
    assert len(chain) == 5


class LinkRecorder:
    """A cache listener that remembers each stored block's (parent, tokens), then tells
    the index: what a block-manager hash alone no longer says."""

    def __init__(self, index: BlockHashIndex) -> None:
        self.index = index
        self.links: dict[BlockHash, tuple[BlockHash, BlockTokens]] = {}

    def stored(self, block: BlockHash, parent: BlockHash, tokens: BlockTokens) -> None:
        self.links[block] = (parent, tokens)
        self.index.stored(block, parent, tokens)

    def evicted(self, block: BlockHash) -> None:
        self.index.evicted(block)


def _reachable_hashes(cached: dict[BlockHash, int],
                      links: dict[BlockHash, tuple[BlockHash, BlockTokens]]) -> set[int]:
    """Every cached block whose chain reaches the root, hashed from the root up."""
    out = set()
    for block in cached:
        chain = [block]
        while links[chain[-1]][0] != ROOT_HASH and links[chain[-1]][0] in cached \
                and len(chain) <= len(cached):
            chain.append(links[chain[-1]][0])
        if links[chain[-1]][0] != ROOT_HASH:
            continue  # an ancestor is gone: unreachable
        stable = 0
        for link in reversed(chain):
            stable = stable_block_hash(stable, links[link][1])
        out.add(stable)
    return out


def test_the_index_answers_as_the_block_managers_own_lookups_do() -> None:
    """Requests with shared heads run through a cache small enough to evict all the time:
    after each, the index reports every block a lookup can reach, each block is hashed
    once, and for probe prompts a router's answer from the report (the leading run of the
    prompt's chain) equals the block manager's own lookup."""
    import random

    rng = random.Random(5)
    manager, index = indexed(24)
    recorder = manager.cache_listener = LinkRecorder(index)
    heads = [[rng.randrange(1, 50) for _ in range(2 * BLOCK)] for _ in range(3)]

    def prompt() -> list[int]:
        head = rng.choice(heads)[: rng.randrange(1, 2 * BLOCK + 1)]
        return head + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 4 * BLOCK))]

    num_cached = 0  # keys that joined the cache: each is hashed once, when it joins
    for step in range(300):
        before = set(manager.cached_blocks)
        run_and_free(manager, f"r{step}", prompt())
        num_cached += len(set(manager.cached_blocks) - before)
        assert index.num_hashed == num_cached, step
        reported = index.report()["device"]
        assert len(reported) == len(set(reported)) == len(index) <= len(manager.cached_blocks)
        assert _reachable_hashes(manager.cached_blocks, recorder.links) <= set(reported), step
        for probe_tokens in (prompt(), prompt()):
            probe = Request("probe", probe_tokens, SamplingParams(max_tokens=1), 0.0)
            hits = len(manager.find_cached_prefix(probe))
            chain = prompt_block_hashes(probe_tokens, BLOCK)
            assert leading_run(chain, frozenset(reported)) == hits, step
