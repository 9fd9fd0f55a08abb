"""The simulator's SimBlockManager.mark_private: a request's own blocks hashed only if it is
preempted, with the same hits and the same free-block reuse order as the engine's
BlockManager, which hashes every block as it fills (up to which of its anonymous blocks,
findable by nobody, fills which place)."""

from __future__ import annotations

from iterserve.autoscale.sim.block_manager import SimBlockManager
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.request import Request, RequestStatus
from iterserve.replica.sampling_params import SamplingParams

BLOCK = 4
SHARED = [7, 7, 7, 7, 8, 8]  # a block and a half that other prompts start with


def request(rid: str, own: int, start: int) -> Request:
    """SHARED, then `own` tokens no other prompt has (ids start, start + 1, ...)."""
    prompt = SHARED + list(range(start, start + own))
    return Request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True), 0.0)


def run(manager: BlockManager, req: Request, num_tokens: int) -> None:
    """Admit it (taking its prefix hits) and compute num_tokens of it, as a step would."""
    hits = manager.find_cached_prefix(req)
    manager.allocate(req, num_tokens - len(hits) * BLOCK, hits)
    req.num_computed_tokens = num_tokens
    manager.mark_computed(req)


def managers() -> tuple[BlockManager, SimBlockManager]:
    """The engine's (eager: hashes every block as it fills) and the simulator's (lazy)."""
    return BlockManager(40, BLOCK, True), SimBlockManager(40, BLOCK, True)


def assert_same_reuse_order(eager: BlockManager, lazy: SimBlockManager) -> None:
    """The same order, where lazy's anonymous blocks hold the places of the same blocks
    (in some order) in eager's."""
    anonymous = lazy.free_pool.anonymous_blocks()
    want, got = eager.free_pool.in_reuse_order(), lazy.free_pool.in_reuse_order()
    assert [None if b in anonymous else b for b in got] == \
        [None if b in anonymous else b for b in want]
    assert {b for b in want if b in anonymous} == anonymous


def test_finished_private_blocks_are_unhashed_but_reused_in_the_same_order() -> None:
    eager, lazy = managers()
    for manager in (eager, lazy):
        a, b = request("a", 13, 100), request("b", 5, 200)
        if manager is lazy:
            manager.mark_private("a", len(SHARED) // BLOCK)
            manager.mark_private("b", len(SHARED) // BLOCK)
        run(manager, a, 19)  # 4 full blocks: the shared one, then 3 holding own tokens
        run(manager, b, 10)  # finds the shared block
        a.status = b.status = RequestStatus.FINISHED_LENGTH
        manager.free(a)
        manager.free(b)
        manager.check_invariants()
    assert_same_reuse_order(eager, lazy)
    assert len(lazy.free_pool.anonymous_blocks()) == 4  # a's 3 own full blocks, b's 1
    assert len(eager.cached_blocks) == 5 and len(lazy.cached_blocks) == 1  # only SHARED's
    assert not lazy.private_from
    again_eager, again_lazy = request("c", 3, 300), request("c", 3, 300)
    assert eager.find_cached_prefix(again_eager) == lazy.find_cached_prefix(again_lazy) != []


def test_a_preempted_private_request_finds_its_own_blocks_when_readmitted() -> None:
    eager, lazy = managers()
    found = []
    for manager in (eager, lazy):
        a = request("a", 13, 100)
        if manager is lazy:
            manager.mark_private("a", 1)
        run(manager, a, 17)
        manager.free(a)  # preempted: still running when its blocks go
        a.num_computed_tokens, a.num_preemptions = 0, 1
        if manager is lazy:
            assert lazy.private_from.get("a") == 1
        found.append(manager.find_cached_prefix(a))
        run(manager, a, 19)
        a.status = RequestStatus.FINISHED_LENGTH
        manager.free(a)
        manager.check_invariants()
    assert found[0] == found[1] and len(found[0]) == 4
    assert_same_reuse_order(eager, lazy)
