"""Synthetic prompts: token ids a simulated workload names without holding them.

`SyntheticPrompt` is a shared head (a tenant's context, a chat's history) and a run of
tokens no other request has (`unique_start`); `PackedPrefixes` packs the heads once per
cluster for the simulated block managers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from iterserve.replica.block_keys import CacheNamespace

UNIQUE_BASE = 1 << 31  # own tokens: ids in [2^31, 2^31 + 2^30 + 2^16), above any vocabulary


def unique_start(i: int) -> int:
    """Where request i's own token ids start: distinct for every i < 2^30 (an odd multiplier
    is a bijection mod 2^30), and prompts share a cache block only if they share its whole
    chain of blocks before it, so equal starts are the only way two could collide.
    Token ids stay below 2^32, as the router's prefix hash needs."""
    return UNIQUE_BASE + (i * 2654435761) % (1 << 30)


class SyntheticPrompt(Sequence):
    """A prompt that costs no memory until a replica runs it: a shared prefix (a tuple
    held by reference, e.g. a tenant's context) followed by `num_unique` tokens that no
    other prompt has (ids unique_start, unique_start + 1, ...; pick disjoint ranges).

    Hundreds of thousands of queued requests would otherwise hold their token lists for the
    whole run. Iterating, slicing and len() are C-speed (itertools / range). A simulated
    replica's `Request` holds it as its prompt_token_ids, in place of the list (the block
    manager reads the prompt from `packed` bytes; see SimulatedReplica.add), so it answers as that
    list does: slices are lists, and `prompt + outputs` is a list.

    private: no other request's prompt holds any of its own tokens (not even inside
    another prompt's prefix, as a chat's next turn holds this one), so no other request can
    find its cache blocks from the first one holding an own token on: the simulated replica
    hashes those blocks only if the request is preempted (`SimBlockManager.mark_private`).

    cache_namespace: the prefix-cache namespace its blocks live in (its tenant's salt:
    replica/block_keys.py; b"" the shared one): the simulated replicas and the cluster's
    prefix index key its first block in it, as the engine keys a request's.
    """

    __slots__ = ("prefix", "unique_start", "num_unique", "private", "cache_namespace")

    def __init__(self, prefix: tuple[int, ...], unique_start: int, num_unique: int,
                 private: bool = False, cache_namespace: CacheNamespace = b"") -> None:
        if num_unique < 0:
            raise ValueError("num_unique must be >= 0")
        self.prefix = prefix
        self.unique_start = unique_start
        self.num_unique = num_unique
        self.private = private
        self.cache_namespace = cache_namespace

    def in_namespace(self, cache_namespace: CacheNamespace) -> SyntheticPrompt:
        """The same prompt (its prefix shared by reference) in another cache namespace."""
        return SyntheticPrompt(self.prefix, self.unique_start, self.num_unique, self.private,
                               cache_namespace)

    def first_private_block(self, block_size: int) -> int | None:
        """The index of its first cache block that holds an own token, if it is private."""
        if not self.private or self.num_unique == 0:
            return None
        return len(self.prefix) // block_size

    def __len__(self) -> int:
        return len(self.prefix) + self.num_unique

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.prefix,
                               range(self.unique_start, self.unique_start + self.num_unique))

    def __getitem__(self, index: int | slice) -> Any:  # noqa: ANN401
        if isinstance(index, slice):
            return list(self)[index] if index.step not in (None, 1) or (
                index.start is not None and index.start < 0) else self._slice(index)
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(index)
        p = len(self.prefix)
        return self.prefix[index] if index < p else self.unique_start + index - p

    def _slice(self, index: slice) -> list[int]:
        start, stop, _ = index.indices(len(self))
        p = len(self.prefix)
        head = list(self.prefix[start:min(stop, p)])
        lo, hi = max(start, p) - p, max(stop, p) - p
        head.extend(range(self.unique_start + lo, self.unique_start + hi))
        return head

    def __add__(self, other: Sequence[int]) -> list[int]:
        out = list(self)
        out.extend(other)
        return out

    def packed(self, prefix_bytes: bytes) -> bytes:
        """Its tokens as int64 bytes (`array("q", self).tobytes()`), given the prefix's:
        the unique run through numpy, a tenth of the cost of converting a list of ints."""
        return prefix_bytes + np.arange(self.unique_start, self.unique_start + self.num_unique,
                                        dtype=np.int64).tobytes()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SyntheticPrompt):
            return (self.prefix, self.unique_start, self.num_unique, self.cache_namespace) == (
                other.prefix, other.unique_start, other.num_unique, other.cache_namespace)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.prefix, self.unique_start, self.num_unique, self.cache_namespace))

    def __repr__(self) -> str:
        return (f"SyntheticPrompt(prefix={len(self.prefix)} tokens, "
                f"unique {self.unique_start}+{self.num_unique})")


class PackedPrefixes:
    """The int64 bytes of the shared prefixes of SyntheticPrompts, packed once per cluster
    (a tenant's context is shared by hundreds of requests). Keyed by the prefix tuple's
    identity (held, so that the id is not reused); at most max_entries, oldest dropped."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._packed: dict[int, tuple[tuple[int, ...], bytes]] = {}

    def prompt_bytes(self, prompt: SyntheticPrompt) -> bytes:
        """`array("q", prompt).tobytes()`."""
        return prompt.packed(self.prefix_bytes(prompt))

    def prefix_bytes(self, prompt: SyntheticPrompt) -> bytes:
        """`array("q", prompt.prefix).tobytes()`."""
        entry = self._packed.get(id(prompt.prefix))
        if entry is None:
            if len(self._packed) >= self.max_entries:
                del self._packed[next(iter(self._packed))]
            entry = (prompt.prefix, np.array(prompt.prefix, dtype=np.int64).tobytes())
            self._packed[id(prompt.prefix)] = entry
        return entry[1]
