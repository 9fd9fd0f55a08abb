"""KVAwareRouter with the replicas' own prefix-cache reports (block hashes in their routing
stats), built by hand as tests/unit/test_router_scoring.py does: no Ray processes."""

from __future__ import annotations

import asyncio
import time

from block_hash_oracle import prompt_block_hashes

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.replica_cache_reports import ParsedLoads, cached_prefix_tokens
from iterserve.autoscale.signals import ReplicaLoad

BLOCK = 16
PROMPT = list(range(1000, 1000 + 40 * BLOCK + 5))  # 40 full blocks and a bit
# the load terms off: only the cache can tell the two replicas apart
CFG = dict(prefix_affinity=False, routed_work_weight=0.0)


def load(hashes: list[int] | None = None, block_size: int = BLOCK, ts: float | None = None
         ) -> ReplicaLoad:
    plain = ReplicaLoad(kv_usage=0.1, num_waiting=0, num_running=1, num_free_blocks=900,
                        num_total_blocks=1000, step_token_rate=0.0,
                        timestamp=time.time() if ts is None else ts)
    return plain.with_cached_blocks(hashes, block_size)


class _FakeReplica:
    def __init__(self, rid: str, stats: dict) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(rid, DeploymentID("LLMReplica", "app"))
        self.routing_stats = stats
        self.max_ongoing_requests = 64
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "n", None, set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _router(**kwargs: object):  # noqa: ANN202 - a KVAwareRouter, imported lazily (Ray)
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from iterserve.autoscale.router import KVAwareRouter

    router = KVAwareRouter(deployment_id=DeploymentID("LLMReplica", "app"),
                           handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**RouterConfig(**{**CFG, **kwargs}).model_dump())
    return router


def _pending(prompt: list[int], rid: str):  # noqa: ANN202 - a PendingRequest
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    meta = RequestMetadata(request_id=rid, internal_request_id=rid)
    return PendingRequest(args=[prompt], kwargs={}, metadata=meta, future=None)


def _firsts(router, replicas: list[_FakeReplica], n: int = 12) -> list[str]:  # noqa: ANN001
    return [asyncio.run(router.choose_replicas(replicas, _pending(PROMPT, f"q{i}")))[0][0]
            .replica_id.unique_id for i in range(n)]


def _two(holder_hashes: list[int] | None, other_hashes: list[int] | None
         ) -> list[_FakeReplica]:
    return [_FakeReplica("holder", load(holder_hashes).to_dict()),
            _FakeReplica("other", load(other_hashes).to_dict())]


def test_the_replica_that_reported_the_prefix_ranks_first() -> None:
    chain = prompt_block_hashes(PROMPT, BLOCK)
    unrelated = prompt_block_hashes([7] * len(PROMPT), BLOCK)
    router = _router()
    assert set(_firsts(router, _two(chain, unrelated))) == {"holder"}
    assert set(_firsts(router, _two(chain, None))) == {"holder"}  # other: no report
    # half the prefix on one, none on the other: the half wins too
    assert set(_firsts(router, _two(chain[:20], []))) == {"holder"}


def test_without_reports_or_with_them_switched_off_the_shuffle_decides() -> None:
    chain = prompt_block_hashes(PROMPT, BLOCK)
    assert set(_firsts(_router(), _two(None, None), n=40)) == {"holder", "other"}
    off = _router(use_replica_cache_reports=False)
    assert set(_firsts(off, _two(chain, None), n=40)) == {"holder", "other"}


def test_the_chosen_replica_is_charged_only_its_uncached_prompt_tokens() -> None:
    chain = prompt_block_hashes(PROMPT, BLOCK)
    router = _router()
    replicas = _two(chain[:10], [])
    pending = _pending(PROMPT, "r1")
    chosen = asyncio.run(router.choose_replicas(replicas, pending))[0][0]
    router.on_request_routed(pending, chosen.replica_id, None)
    work = router._core.routed_work.snapshot(time.time())
    assert round(work[chosen.replica_id]) == len(PROMPT) - 10 * BLOCK
    # a request routed without a choice first (or forgotten) pays its whole prompt
    other = replicas[1].replica_id
    router.on_request_routed(_pending(PROMPT, "r2"), other, None)
    assert round(router._core.routed_work.snapshot(time.time())[other]) == len(PROMPT)


def test_cached_prefix_tokens_per_block_size_and_leaves_a_token() -> None:
    short = list(range(3 * BLOCK))  # exactly 3 blocks: only 2 can be hits
    by8 = prompt_block_hashes(short, 8)
    loads = [load(prompt_block_hashes(short, BLOCK)), load(by8, block_size=8), load(), None]
    hits = cached_prefix_tokens(short, ["a", "b", "c", "d"], loads)
    assert hits == {"a": 2 * BLOCK, "b": 5 * 8}  # c and d reported nothing: left out
    assert cached_prefix_tokens(short, ["c", "d"], [load(), None]) is None


def test_routing_stats_are_parsed_once_per_update() -> None:
    parsed = ParsedLoads()
    stats = load(prompt_block_hashes(PROMPT, BLOCK)).to_dict()
    first = parsed.load("a", stats)
    assert parsed.load("a", stats) is first  # the same dict: not parsed again
    newer = dict(stats, timestamp=stats["timestamp"] + 1)
    assert parsed.load("a", newer) is not first
    second = parsed.load("a", newer)
    newer["timestamp"] += 1  # updated in place: the timestamp still tells
    assert parsed.load("a", newer) is not second
    parsed.keep_only(["b"])
    assert parsed.load("a", newer) is not first and parsed.load("a", None) is None


def test_the_lazy_chain_walk_answers_as_hashing_the_whole_prompt_does() -> None:
    """cached_prefix_tokens hashes the prompt only as deep as some replica holds it; its
    answers must equal the leading run of the whole prompt's chain in each report."""
    import random

    from block_hash_oracle import leading_run

    rng = random.Random(3)
    for _ in range(200):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 12 * BLOCK))]
        loads, expected = [], {}
        for rid in range(4):
            size = rng.choice((BLOCK, 8))
            chain = prompt_block_hashes(prompt, size)
            depth = rng.randrange(len(chain) + 1)
            reported = chain[:depth] + [h for h in chain[depth + 1:] if rng.random() < 0.5]
            loads.append(load(reported + [rng.getrandbits(64)], block_size=size))
            expected[rid] = leading_run(chain, frozenset(reported)) * size
        loads.append(None)  # a replica not yet polled: left out
        assert cached_prefix_tokens(prompt, [0, 1, 2, 3, 4], loads) == expected


def test_the_router_reads_the_requests_cache_namespace_from_its_kwargs() -> None:
    """A tenant's prompt (cache_namespace in the handle call's kwargs, as the ingress sends
    it) ranks first the replica holding that prompt in that namespace, and no other's."""
    from iterserve.replica.block_hashes import ROOT, stable_block_hash
    from iterserve.replica.block_keys import block_tokens, cache_namespace, namespaced

    salt = cache_namespace(salt="acme")
    parent, chain = ROOT, []
    for i in range((len(PROMPT) - 1) // BLOCK):
        chunk = block_tokens(PROMPT[i * BLOCK:(i + 1) * BLOCK])
        parent = stable_block_hash(parent, namespaced(salt, chunk) if i == 0 else chunk)
        chain.append(parent)
    router = _router()

    def firsts(namespace: bytes | None) -> set[str]:
        chosen = set()
        for i in range(24):  # two replicas tied 24 times in one order: p = 2**-23
            pending = _pending(PROMPT, f"n{i}")
            if namespace is not None:
                pending.kwargs["cache_namespace"] = namespace
            ranked = asyncio.run(router.choose_replicas(_two(chain, []), pending))
            chosen.add(ranked[0][0].replica_id.unique_id)
        return chosen

    assert firsts(salt) == {"holder"}
    assert firsts(None) == {"holder", "other"}  # the shared namespace: nobody holds it
    assert firsts(cache_namespace(salt="beta")) == {"holder", "other"}
