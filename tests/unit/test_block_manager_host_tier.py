"""The block manager with a host KV tier, without a model: which copies a step plans."""

from __future__ import annotations

import itertools

from iterserve.replica.block_manager import BlockManager, host_hit
from iterserve.replica.host_kv_index import HostKVIndex
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams

_ids = itertools.count()
BLOCK = 4


def request(tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return Request(request_id=f"h{next(_ids)}", prompt_token_ids=tokens, sampling_params=params,
                   arrival_time=0.0)


def run_prefill(manager: BlockManager, req: Request) -> None:
    """Admit, compute the whole prompt, finish: its full blocks stay cached, free."""
    hits = manager.find_cached_prefix(req)
    manager.allocate(req, req.num_tokens - len(hits) * BLOCK, hits)
    manager.mark_computed(req, req.num_tokens)
    manager.free(req)
    manager.check_invariants()


def test_a_lookup_continues_on_the_host_where_the_device_misses() -> None:
    manager = BlockManager(4, BLOCK, True, HostKVIndex(8))
    first = list(range(100, 113))  # 3 full blocks and 1 token
    run_prefill(manager, request(first))
    run_prefill(manager, request(list(range(500, 508))))  # evicts the first's block 2
    stores, loads = manager.take_kv_copies()
    assert len(stores) == 1 and loads == []
    evicted_block, slot = stores[0]

    again = request(first)
    hits = manager.find_cached_prefix(again)
    assert hits[2] == host_hit(slot) and hits[0] >= 0 and hits[1] >= 0  # device, device, host
    manager.record_prefix_lookup(again.num_prompt_tokens, hits)
    manager.allocate(again, 1, hits)
    table = manager.block_table(again.request_id)
    stores, loads = manager.take_kv_copies()
    assert loads == [(slot, table[2])]  # copied back into the block the request holds
    assert again.num_computed_tokens == 3 * BLOCK
    assert (manager.prefix_hits, manager.host_queries, manager.host_hits) == (8, 5, 4)
    manager.check_invariants()
    manager.free(again)
    manager.check_invariants()
    assert manager.num_used_blocks == 0


def test_a_block_being_copied_back_is_never_overwritten_in_the_same_step() -> None:
    index = HostKVIndex(1)
    manager = BlockManager(4, BLOCK, True, index)
    first = list(range(100, 113))
    run_prefill(manager, request(first))
    run_prefill(manager, request(list(range(500, 508))))
    (_, slot), = manager.take_kv_copies()[0]
    kept = index.entry(slot).key
    again = request(first)
    hits = manager.find_cached_prefix(again)
    manager.allocate(again, 1, hits)  # the blocks it takes evict two cached blocks
    stores, loads = manager.take_kv_copies()
    assert stores == [] and loads == [(slot, manager.block_table(again.request_id)[2])]
    assert index.lookup(kept) == slot  # the tier's one slot was pinned: nothing stored
    assert index.can_store()  # unpinned once the step's copies are handed over
    manager.check_invariants()
