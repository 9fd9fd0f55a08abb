"""The simulator's speed structures give exactly the answers of the code they stand in for."""

from __future__ import annotations

import random
from array import array

from iterserve.autoscale.router_policy import Correction, InFlightTracker
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.block_manager import SimBlockManager
from iterserve.autoscale.sim.prefix import PromptBlockKeys
from iterserve.autoscale.sim.prompts import PackedPrefixes, SyntheticPrompt
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams


def _brute_force_corrections(entries: dict[str, tuple[str, float, int, int]],
                             loads: dict[str, ReplicaLoad | None]) -> dict[str, Correction]:
    """InFlightTracker.corrections as it was: one pass over every request in flight."""
    counts: dict[str, list[int]] = {}
    for rid, at, tokens, prefill in entries.values():
        entry = counts.setdefault(rid, [0, 0, 0, 0])
        entry[2] += tokens
        load = loads.get(rid)
        if load is None or at > load.timestamp:
            entry[0] += 1
            entry[1] += tokens
            entry[3] += prefill
    return {rid: Correction(n, t, c, p) for rid, (n, t, c, p) in counts.items()}


def test_in_flight_corrections_equal_a_full_scan() -> None:
    rng = random.Random(0)
    tracker: InFlightTracker[str] = InFlightTracker()
    entries: dict[str, tuple[str, float, int, int]] = {}
    replicas = [f"r{i}" for i in range(5)]
    loads: dict[str, ReplicaLoad | None] = {}
    now = 0.0
    for step in range(3000):
        now += rng.expovariate(10.0)
        at = now - (rng.random() if step % 97 == 0 else 0.0)  # now and then a clock step back
        op = rng.random()
        if op < 0.5 or not entries:
            rid, req = rng.choice(replicas), f"q{rng.randrange(400)}"  # ids are reused too
            tokens, prefill = rng.randrange(1, 900), rng.randrange(0, 500)
            tracker.routed(req, rid, at, prompt_tokens=tokens, prefill_tokens=prefill)
            entries[req] = (rid, at, tokens, prefill)
        elif op < 0.9:
            req = rng.choice(sorted(entries)) if rng.random() < 0.9 else "unknown"
            assert tracker.completed(req) == (entries.pop(req)[0] if req in entries else None)
        else:
            gone = rng.choice(replicas)
            tracker.forget_replica(gone)
            entries = {k: v for k, v in entries.items() if v[0] != gone}
        for rid in replicas:  # stats arrive now and then; most calls see the same ones
            if rng.random() < 0.2:
                loads[rid] = None if rng.random() < 0.2 else ReplicaLoad(
                    kv_usage=0.1, num_waiting=0, num_running=1, num_free_blocks=1,
                    num_total_blocks=2, step_token_rate=0.0, timestamp=now - rng.random())
            elif rng.random() < 0.02:
                loads.pop(rid, None)
        assert tracker.corrections(loads) == _brute_force_corrections(entries, loads)
        assert len(tracker) == len(entries)
        assert all(tracker.in_flight(r) == sum(1 for v in entries.values() if v[0] == r)
                   for r in replicas)


def test_prompt_block_keys_find_what_the_block_manager_finds() -> None:
    rng = random.Random(1)
    bm = BlockManager(num_blocks=200, block_size=4, enable_prefix_caching=True)
    shared = [rng.randrange(50) for _ in range(24)]
    for i in range(6):  # requests that cache different lengths of the shared prefix
        tokens = shared[: 4 * i + 2] + [100 + i] * 5
        request = Request(f"c{i}", tokens, SamplingParams(max_tokens=1), 0.0)
        bm.allocate(request, len(tokens))
        request.num_computed_tokens = len(tokens)
        bm.mark_computed(request)
    keys = PromptBlockKeys(block_size=4)
    for n in range(0, 30):
        for prompt in (tuple(shared[:n]) + (7,), tuple(shared[:n])):
            probe = Request("probe", list(prompt), SamplingParams(max_tokens=1), 0.0)
            want = len(bm.find_cached_prefix(probe))
            assert keys.num_cached_blocks(prompt, bm.cached_blocks) == want
            assert keys.num_cached_blocks(prompt, bm.cached_blocks) == want  # memoised


def test_register_output_blocks_equals_mark_computed() -> None:
    """The simulator's one-block registration of a decode equals the engine's mark_computed."""
    managers = [BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=True),
                SimBlockManager(num_blocks=64, block_size=4, enable_prefix_caching=True)]
    prompt = [3, 1, 4, 1, 5, 9]
    for fast, bm in zip((False, True), managers, strict=True):
        request = Request("a", list(prompt), SamplingParams(max_tokens=30), 0.0)
        bm.allocate(request, len(prompt))
        request.num_computed_tokens = len(prompt)
        bm.mark_computed(request)
        for _ in range(20):  # decode: one token of 7 a step
            bm.allocate(request, 1)
            request.output_token_ids.append(7)
            request.num_computed_tokens += 1
            if request.num_computed_tokens % 4:
                continue
            if not (fast and request.num_computed_tokens - 4 >= len(prompt)
                    and bm.register_output_blocks([request], [(7,) * 4]) == 1):
                bm.mark_computed(request)
    assert managers[0].cached_blocks == managers[1].cached_blocks
    assert managers[0].num_registered == managers[1].num_registered
    assert managers[0].block_keys == managers[1].block_keys
    # More than one block behind: it declines, and mark_computed does the work.
    bm = managers[1]
    request = Request("b", [7] * 12, SamplingParams(max_tokens=1), 0.0)
    bm.allocate(request, 12)
    request.num_computed_tokens = 12
    assert bm.register_output_blocks([request], [(7,) * 4]) == 0


def test_cluster_prefix_cache_answers_what_each_replica_answers() -> None:
    from iterserve.autoscale.sim.prefix import ClusterPrefixCache

    rng = random.Random(2)
    shared = [rng.randrange(50) for _ in range(24)]
    keys = PromptBlockKeys(block_size=4)
    index = ClusterPrefixCache(keys)
    managers = {}
    for name, depth in (("a", 0), ("b", 2), ("c", 5), ("d", 3)):
        bm = BlockManager(num_blocks=100, block_size=4, enable_prefix_caching=True)
        tokens = shared[: 4 * depth] + [200] * 3
        request = Request("w", tokens, SamplingParams(max_tokens=1), 0.0)
        bm.allocate(request, len(tokens))
        request.num_computed_tokens = len(tokens)
        bm.mark_computed(request)
        managers[name] = bm
        if name != "d":  # d: a replica the index was not told about holds nothing for it
            index.add_replica(name, bm.cached_blocks)
            index.routed(name, tokens, 1, 200)
    for n in range(0, 26):
        prompt = tuple(shared[:n]) + (7,)
        want = {name: 4 * keys.num_cached_blocks(prompt, bm.cached_blocks)
                for name, bm in managers.items() if name != "d"}
        got = index(prompt, ["a", "b", "c", "d"])
        assert got == {name: hit for name, hit in want.items() if hit}
    index.remove_replica("c")
    assert "c" not in index(tuple(shared) + (7,), ["a", "b", "c"])
    assert "b" not in index(tuple(shared) + (7,), ["a", "c"])  # answers only those asked
    # a first block that no request routed anywhere began with: nobody is asked
    assert index((99,) * 9, ["a", "b", "c"]) == {}
    # short prompts: their first block is completed by the generated tokens
    short = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    request = Request("s", [5, 6], SamplingParams(max_tokens=3), 0.0)
    short.allocate(request, 4)
    request.output_token_ids += [8, 8]
    request.num_computed_tokens = 4
    short.mark_computed(request)
    index.add_replica("s", short.cached_blocks)
    index.routed("s", [5, 6], 3, 8)
    assert index((5, 6, 8, 8, 1), ["s"]) == {"s": 4}


def _state(bm: BlockManager) -> tuple:
    return (bm.block_tables, bm.num_registered, bm.cached_blocks, bm.free_pool.in_reuse_order(),
            bm.ref_counts, bm.block_keys)


def test_batched_decode_block_work_equals_one_request_at_a_time() -> None:
    """append_blocks == the engine's allocate(request, 1) each; register_output_blocks ==
    its mark_computed each (stopping where it declines), cached blocks reused included."""
    rng = random.Random(3)
    managers = [BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True),
                SimBlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True)]
    requests: list[list[Request]] = [[], []]
    prompts = [[rng.randrange(3) for _ in range(6)] for _ in range(6)]  # few ids: shared keys
    for batched, bm in enumerate(managers):
        for i, tokens in enumerate(prompts):  # 6 prompt tokens: the second block partial
            request = Request(f"q{i}", list(tokens), SamplingParams(max_tokens=20), 0.0)
            bm.allocate(request, 6)
            request.num_computed_tokens = 6
            bm.mark_computed(request)
            requests[batched].append(request)
        for step in range(14):  # decode: one token of 7 a step, as the cohort does
            growing = [r for r in requests[batched] if (r.num_computed_tokens + 1) % 4 == 1]
            if batched:
                bm.append_blocks([r.request_id for r in growing])
            else:
                for r in growing:
                    bm.allocate(r, 1)
            for r in requests[batched]:
                r.output_token_ids.append(7)
                r.num_computed_tokens += 1
            for r in requests[batched]:  # a block with prompt tokens: the general path
                if r.num_computed_tokens % 4 == 0 and \
                        r.num_computed_tokens - 4 < r.num_prompt_tokens:
                    bm.mark_computed(r)
            full = [r for r in requests[batched] if r.num_computed_tokens % 4 == 0
                    and r.num_computed_tokens - 4 >= r.num_prompt_tokens]
            runs = [(7,) * 4] * len(full)
            if batched:
                assert bm.register_output_blocks(full, runs) == len(full)
            else:
                for r in full:
                    bm.mark_computed(r)
            if step == 6:  # a finish frees blocks that later takes reuse
                bm.free(requests[batched].pop(0))
    assert _state(managers[0]) == _state(managers[1])
    # it stops where a request is not exactly one block on (here: two blocks behind)
    bm = managers[1]
    behind = Request("b", [7] * 12, SamplingParams(max_tokens=1), 0.0)
    bm.allocate(behind, 12)
    behind.num_computed_tokens = 12
    ok = requests[1][0]
    assert bm.register_output_blocks([behind, ok], [(7,) * 4] * 2) == 0
    try:
        bm.append_blocks(["b"] * (bm.num_free_blocks + 1))
    except RuntimeError:
        pass
    else:
        raise AssertionError("append_blocks took more blocks than are free")


def test_block_keys_take_one_form_per_content_even_past_int64() -> None:
    """block_tokens: bytes for int64 token ids, a tuple otherwise, decided per block, so
    a prefix registered in one pass is found block by block (and by PromptBlockKeys)."""
    from iterserve.replica.block_keys import block_tokens

    assert block_tokens([1, 2]) == block_tokens((1, 2)) != block_tokens([2, 1])
    assert block_tokens([2**63, 1]) == (2**63, 1)
    huge = [5, 6, 7, 8, 2**64, 3, 3, 3, 9, 9, 9, 9, 1]  # the second block does not fit int64
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    writer = Request("w", list(huge), SamplingParams(max_tokens=1), 0.0)
    bm.allocate(writer, len(huge))
    writer.num_computed_tokens = len(huge)
    bm.mark_computed(writer)
    reader = Request("r", list(huge), SamplingParams(max_tokens=1), 0.0)
    assert len(bm.find_cached_prefix(reader)) == 3
    assert PromptBlockKeys(4).num_cached_blocks(tuple(huge), bm.cached_blocks) == 3


def test_packed_synthetic_prompts_key_the_prefix_cache_as_converted_tokens_do() -> None:
    """A simulated request's prompt bytes (numpy, shared prefix packed once) give the block
    manager the keys it builds from the token list, chunk by chunk and past the prompt."""
    rng = random.Random(3)
    packer = PackedPrefixes(max_entries=2)
    heads = [tuple(rng.randrange(16, 32000) for _ in range(n)) for n in (0, 5, 64, 300)]
    managers = [BlockManager(400, 16, True), BlockManager(400, 16, True)]
    hit_blocks = 0
    for i in range(40):
        prompt = SyntheticPrompt(rng.choice(heads), 100_000 + 1000 * i, rng.randint(0, 200))
        if not len(prompt):
            continue
        packed = packer.prompt_bytes(prompt)
        assert packed == array("q", list(prompt)).tobytes()
        found = []
        for bm, use_bytes in zip(managers, (False, True), strict=True):
            # the simulator's Request holds the SyntheticPrompt itself, with its bytes
            tokens = prompt if use_bytes else list(prompt)
            request = Request(f"q{i}", tokens, SamplingParams(max_tokens=40), 0.0)  # type: ignore[arg-type]
            request.prompt_token_bytes = packed if use_bytes else None
            hits = bm.find_cached_prefix(request)
            found.append(hits)
            bm.allocate(request, len(prompt) - len(hits) * 16 + 40, hits)
            chunk = rng.randint(1, 64)
            while request.num_computed_tokens < len(prompt) + 40:  # prefill chunks, then decodes
                step = min(chunk, len(prompt) + 40 - request.num_computed_tokens)
                request.num_computed_tokens += step
                while request.num_tokens < max(request.num_computed_tokens, len(prompt)):
                    request.output_token_ids.append(7)
                bm.mark_computed(request)
            bm.free(request)
        assert found[0] == found[1]
        hit_blocks += len(found[0])
    assert hit_blocks > 20  # the shared heads were found again
    assert managers[0].cached_blocks == managers[1].cached_blocks
    assert managers[0].block_keys == managers[1].block_keys
