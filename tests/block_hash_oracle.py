"""The readable oracle of the stable block hashes a replica reports: a prompt's whole chain,
spelled out. tests/unit/test_block_hashes.py holds the replica's BlockHashIndex to it, and
tests/unit/test_router_cache_reports.py the router's reading of the reports
(replica_cache_reports.cached_prefix_tokens)."""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.replica.block_hashes import ROOT, stable_block_hash
from iterserve.replica.block_keys import block_tokens


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of the prompt's blocks a prefix cache could hit: its full blocks
    but the one holding its last token (a hit always leaves one token to compute, as
    `BlockManager.find_cached_prefix` does)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = ROOT
    for i in range((len(token_ids) - 1) // block_size):  # spelled out: this is the oracle
        parent = stable_block_hash(parent, block_tokens(
            token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def leading_run(chain: Sequence[int], cached: frozenset[int] | set[int]) -> int:
    """How many leading hashes of `chain` are in `cached`: the blocks a lookup would hit."""
    for n, block_hash in enumerate(chain):
        if block_hash not in cached:
            return n
    return len(chain)
