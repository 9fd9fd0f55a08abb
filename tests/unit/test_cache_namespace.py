"""Cache namespaces (a tenant's salt, an adapter): a request hits only blocks cached in its
own namespace, and the stable hashes a replica reports for them are the ones the router
computes for a prompt in that namespace."""

from __future__ import annotations

from iterserve.autoscale.replica_cache_reports import cached_prefix_tokens
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.replica.block_hashes import BlockHashIndex
from iterserve.replica.block_keys import block_tokens, cache_namespace, namespaced
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams

BLOCK = 4
PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks a lookup could hit


def request(rid: str, namespace: bytes, prompt: list[int] = PROMPT) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), 0.0, cache_namespace=namespace)


def run_and_free(manager: BlockManager, req: Request) -> int:
    """Serve the request's prompt and finish it; how many blocks its lookup hit."""
    hits = manager.find_cached_prefix(req)
    manager.allocate(req, len(req.prompt_token_ids), hits)
    req.num_computed_tokens = len(req.prompt_token_ids)
    manager.mark_computed(req)
    manager.free(req)
    return len(hits)


def test_cache_namespace_is_empty_without_parts_and_orders_its_parts() -> None:
    assert cache_namespace() == b""
    assert cache_namespace(salt=None, adapter="") == b""
    assert cache_namespace(salt="t1", adapter="a") == cache_namespace(adapter="a", salt="t1")
    assert cache_namespace(salt="t1") != cache_namespace(adapter="t1")


def test_namespaced_keys_differ_from_plain_ones_in_both_forms() -> None:
    tokens = block_tokens([1, 2, 3, 4])
    assert namespaced(b"", tokens) == tokens
    assert namespaced(b"salt=a", tokens) != tokens
    assert namespaced(b"salt=a", tokens) != namespaced(b"salt=b", tokens)
    wide = block_tokens([2**70, 1, 2, 3])  # a token beyond int64: the tuple form
    assert isinstance(wide, tuple)
    assert namespaced(b"salt=a", wide) != wide


def test_requests_share_cached_blocks_only_within_a_namespace() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    salt_a, salt_b = cache_namespace(salt="a"), cache_namespace(salt="b")
    assert run_and_free(manager, request("a1", salt_a)) == 0
    assert run_and_free(manager, request("b1", salt_b)) == 0  # same tokens, other namespace
    assert run_and_free(manager, request("plain", b"")) == 0
    assert run_and_free(manager, request("a2", salt_a)) == 3
    assert run_and_free(manager, request("b2", salt_b)) == 3
    assert run_and_free(manager, request("plain2", b"")) == 3
    manager.check_invariants()


def test_the_router_reads_a_namespaced_report_only_in_that_namespace() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    index = manager.cache_listener = BlockHashIndex()
    salt = cache_namespace(salt="tenant-a")
    run_and_free(manager, request("a1", salt))
    load = ReplicaLoad(kv_usage=0.0, num_waiting=0, num_running=0, num_free_blocks=16,
                       num_total_blocks=16, step_token_rate=0.0, timestamp=0.0
                       ).with_cached_blocks(index.report(), BLOCK)
    assert cached_prefix_tokens(PROMPT, ["r"], [load], salt) == {"r": 12}
    assert cached_prefix_tokens(PROMPT, ["r"], [load]) == {"r": 0}
    assert cached_prefix_tokens(PROMPT, ["r"], [load], cache_namespace(salt="b")) == {"r": 0}
