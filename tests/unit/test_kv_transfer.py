"""KV blocks moved between two engines (replica/kv_transfer.py), on the tiny model (CPU, no
Ray): engine A serves a prompt, its blocks are exported and imported into engine B, and B's
greedy tokens equal a computed run's while its prefill reports the prefix as cached."""

from __future__ import annotations

import random

import pytest

from iterserve.replica import EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.kv_transfer import (
    KVTransferRefused,
    export_blocks,
    import_blocks,
    num_held_blocks,
    prompt_chain,
)
from iterserve.replica.make_model import default_model_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
TIER_GIB = 64 * 2 * 4 * BLOCK * 4 * 32 * 4 / 2**30  # 64 blocks of the tiny model (fp32)
PROMPT_BLOCKS = 5  # an 88-token prompt: 5 full blocks a lookup may hit
ALL = 1 << 40  # no byte bound


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(default_model_path())


def engine(model_path: str, **kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=model_path, block_size=BLOCK,
                                              num_gpu_blocks_override=32, **kwargs))


def prompt(seed: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(88)]


def run(engine: LLMEngine, tokens: list[int], namespace: bytes = b"") -> tuple[list[int], int]:
    """One request to its end, invariants checked every step: (its tokens, its cached tokens)."""
    engine.add_request(tokens, GREEDY, cache_namespace=namespace)
    out: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            out += output.new_token_ids
            cached = output.num_cached_tokens
        engine.block_manager.check_invariants()
    return out, cached


def test_imported_blocks_are_a_host_hit_with_the_computed_tokens(model_path: str) -> None:
    holder, receiver = engine(model_path), engine(model_path, kv_offloading_size=TIER_GIB)
    tokens = prompt()
    computed, cached = run(holder, tokens)
    assert cached == 0
    payload = export_blocks(holder, tokens, b"", 0, ALL)
    assert payload is not None and payload.num_blocks == PROMPT_BLOCKS
    assert payload.nbytes == PROMPT_BLOCKS * holder.runner.kv_bytes_per_block
    assert import_blocks(receiver, tokens, b"", payload) == PROMPT_BLOCKS
    chain = prompt_chain(tokens, b"", BLOCK)
    assert num_held_blocks(receiver, chain) == 0  # written by the next step, not before
    pulled, cached = run(receiver, tokens)
    assert pulled == computed
    assert cached == PROMPT_BLOCKS * BLOCK  # the external blocks count as cached
    manager = receiver.block_manager
    assert manager.host_hits == PROMPT_BLOCKS * BLOCK and manager.prefix_hits == 0
    assert manager.kv_blocks_received == PROMPT_BLOCKS
    assert num_held_blocks(receiver, chain) == PROMPT_BLOCKS


def test_a_long_prefix_travels_in_chunks_bounded_in_bytes(model_path: str) -> None:
    holder, receiver = engine(model_path), engine(model_path, kv_offloading_size=TIER_GIB)
    tokens = prompt(7)
    computed, _ = run(holder, tokens)
    per_block = holder.runner.kv_bytes_per_block
    first = 0
    while first < PROMPT_BLOCKS:
        chunk = export_blocks(holder, tokens, b"", first, 2 * per_block + per_block // 2)
        assert chunk is not None and 1 <= chunk.num_blocks <= 2
        assert import_blocks(receiver, tokens, b"", chunk) == chunk.num_blocks
        first += chunk.num_blocks
    assert export_blocks(holder, tokens, b"", 0, per_block - 1).num_blocks == 0
    pulled, cached = run(receiver, tokens)
    assert (pulled, cached) == (computed, PROMPT_BLOCKS * BLOCK)


def test_blocks_of_another_prompt_namespace_or_layout_are_never_used(model_path: str) -> None:
    holder = engine(model_path)
    receiver = engine(model_path, kv_offloading_size=TIER_GIB)
    tokens = prompt()
    run(holder, tokens, namespace=b"salt=a")
    payload = export_blocks(holder, tokens, b"salt=a", 0, ALL)
    assert payload.num_blocks == PROMPT_BLOCKS
    with pytest.raises(KVTransferRefused, match="namespace"):
        import_blocks(receiver, tokens, b"", payload)
    other = tokens[:40] + [t + 1 for t in tokens[40:]]  # the same first two blocks only
    assert import_blocks(receiver, other, b"salt=a", payload) == 2
    assert export_blocks(holder, tokens, b"", 0, ALL).num_blocks == 0  # not in that namespace
    other_layout = engine(model_path, kv_offloading_size=TIER_GIB, dtype="bfloat16")
    with pytest.raises(KVTransferRefused, match="layout"):
        import_blocks(other_layout, tokens, b"salt=a", payload)
    with pytest.raises(KVTransferRefused, match="host KV tier"):
        import_blocks(engine(model_path), tokens, b"salt=a", payload)


def test_blocks_evicted_to_the_holders_host_tier_are_exported_from_there(
        model_path: str) -> None:
    holder = engine(model_path, kv_offloading_size=TIER_GIB)
    receiver = engine(model_path, kv_offloading_size=TIER_GIB)
    tokens = prompt()
    computed, _ = run(holder, tokens)
    for seed in range(8):  # 8 x 6 more blocks through a 32-block device evict the first
        run(holder, prompt(100 + seed))
    chain = prompt_chain(tokens, b"", BLOCK)
    assert all(holder.block_manager.cached_blocks.get(b.key) is None for b in chain)
    payload = export_blocks(holder, tokens, b"", 0, ALL)
    assert payload.num_blocks == PROMPT_BLOCKS
    assert import_blocks(receiver, tokens, b"", payload) == PROMPT_BLOCKS
    assert run(receiver, tokens) == (computed, PROMPT_BLOCKS * BLOCK)


def test_imports_that_push_host_blocks_to_disk_spill_their_bytes_first(
        model_path: str, tmp_path: object) -> None:
    """The receiver's host tier is full (another prompt's and fillers' blocks): the import
    evicts some to the disk tier, whose spills read the old bytes before the import's land,
    and every prompt still gets its computed tokens."""
    holder = engine(model_path)
    receiver = engine(model_path, kv_offloading_size=8 * 2 * 4 * BLOCK * 4 * 32 * 4 / 2**30,
                      kv_offloading_disk_path=str(tmp_path))
    tokens, other = prompt(), prompt(5)
    computed, _ = run(holder, tokens)
    other_computed, _ = run(receiver, other)
    for seed in range(8):  # the other prompt's blocks leave the device for the host tier
        run(receiver, prompt(200 + seed))
    payload = export_blocks(holder, tokens, b"", 0, ALL)
    host = receiver.block_manager.host
    evicted = host.num_evicted
    assert import_blocks(receiver, tokens, b"", payload) == PROMPT_BLOCKS
    assert host.num_evicted == evicted + PROMPT_BLOCKS  # the tier was full: spilled to disk
    assert run(receiver, tokens) == (computed, PROMPT_BLOCKS * BLOCK)
    receiver.runner.disk_tier.flush()
    again, cached = run(receiver, other)
    assert again == other_computed and cached > 0
    assert receiver.block_manager.disk_hits > 0


def test_a_pull_from_a_holder_that_is_gone_computes_at_once(model_path: str) -> None:
    """The receiver's KVPuller (deploy/kv_pull.py) on a real engine: a holder the router no
    longer runs (RouteTargetGone) or one that dies under the call (Ray's ActorDiedError)
    is counted holder_gone and the request computes now, not at the pull's timeout."""
    import asyncio
    import time

    from ray.exceptions import ActorDiedError

    from iterserve.autoscale.route_target_gone import RouteTargetGone
    from iterserve.deploy.kv_pull import KVPullConfig, KVPuller, PullHint
    from iterserve.replica import AsyncLLMEngine

    async def pull_from_gone_holder(error: Exception) -> tuple[str | None, float, list[int]]:
        async def export_call(*_: object) -> list[object]:
            raise error

        config = EngineConfig.from_kwargs(model=model_path, block_size=BLOCK,
                                          num_gpu_blocks_override=32,
                                          kv_offloading_size=TIER_GIB)
        receiver = AsyncLLMEngine(config)
        try:
            puller = KVPuller(receiver, KVPullConfig("always", timeout_s=30.0), "receiver",
                              export_call, lambda outcome, nbytes: None)
            start = time.monotonic()
            outcome = await puller.pull(prompt(), b"", PullHint("holder", 80))
            elapsed = time.monotonic() - start
            tokens = await receiver.call(lambda e: run(e, prompt())[0])
            return outcome, elapsed, tokens
        finally:
            receiver.shutdown()

    computed, _ = run(engine(model_path), prompt())
    for error in (RouteTargetGone("holder"), ActorDiedError()):
        outcome, elapsed, tokens = asyncio.run(pull_from_gone_holder(error))
        assert outcome == "holder_gone"
        assert elapsed < 1.0  # the timeout is 30 s
        assert tokens == computed


def test_the_gather_writes_each_block_into_its_row_in_read_slot_order() -> None:
    """kv_transfer._gather against a torch reference (each block's bytes: every layer's K
    block, then its V block, block-major), in both K layouts, into every row at once and into
    a subset of rows (a payload mixing device blocks and host slots)."""
    import numpy as np
    import torch

    from iterserve.replica.host_kv_tier import block_major
    from iterserve.replica.kv_transfer import _gather

    torch.manual_seed(0)
    layers = [(torch.randn(9, 3, 8, 4), torch.randn(9, 4, 3, 8)) for _ in range(3)]
    blocks = [7, 2, 5]

    def reference(block: int) -> bytes:
        return b"".join(block_major(cache)[block].contiguous().numpy().tobytes()
                        for keys, values in layers for cache in (keys, values))

    width = len(reference(0))
    every = torch.zeros((3, width), dtype=torch.uint8)
    _gather(layers, blocks, every, [0, 1, 2])
    assert [bytes(row.numpy()) for row in every] == [reference(b) for b in blocks]
    mixed = torch.from_numpy(np.zeros((5, width), dtype=np.uint8))
    _gather(layers, blocks, mixed, [4, 0, 2])
    assert bytes(mixed[4].numpy()) == reference(7) and bytes(mixed[0].numpy()) == reference(2)
    assert bytes(mixed[2].numpy()) == reference(5)
    assert not mixed[1].any() and not mixed[3].any()  # rows left for the other tier
