"""A prefix-cache block's key: its tokens (`block_tokens`) and its chain hash (`block_hash`).

The prefix cache is keyed by a chain hash, as vLLM's is: a block's hash is
`block_hash(parent's hash, its tokens)`, the parent of a prompt's first block being
ROOT_HASH, so one int names the whole prefix up to that block (`block_manager`). These are
per-process hashes; `block_hashes` has the stable ones a router in another process uses.

A request's cache namespace (`cache_namespace`: a tenant's salt, vLLM's `cache_salt`, a LoRA
adapter) is folded into its first block's key (`namespaced`), as vLLM folds `cache_salt` and
the adapter into its first block's extra keys: two requests share a cached block only when
their namespaces are equal, and since every later block's hash chains from the first, one
namespaced block keeps the whole chain apart, in every tier and in the router's tables.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

BlockTokens = bytes | tuple[int, ...]  # a block's tokens as its hash reads them: block_tokens
BlockHash = int  # block_hash(parent's BlockHash, tokens): names the prefix up to the block
ROOT_HASH = 0  # the parent of a chain's first block
CacheNamespace = bytes  # cache_namespace(...): b"" for the shared namespace
_NAMESPACE_TAG = b"\xffns"  # no token-bytes key starts so and is longer than a block


def block_tokens(tokens: Sequence[int]) -> BlockTokens:
    """A block's tokens as its prefix-cache key holds them: 8 bytes a token (a bytes object
    caches its own hash and holds no int objects, so a cache of millions of blocks takes a
    third of the memory, and evicting one touches a few cache lines, not one per token),
    or a tuple where a token id does not fit int64. One form per content: equal blocks get
    equal keys, so the prefix cache finds what it found with tuples of ints."""
    try:
        return array("q", tokens).tobytes()
    except (OverflowError, TypeError):
        return tuple(tokens)


def block_hash(parent: BlockHash, tokens: BlockTokens) -> BlockHash:
    """The chain hash of a block whose previous block's hash is `parent` (ROOT_HASH for a
    first block). Python's hash of a tuple: the bytes in it are hashed with a per-process
    key (PYTHONHASHSEED), so these hashes mean nothing in another process (a router there
    uses replica/block_hashes.py's stable ones); 64 bits, like vLLM's builtin block hash."""
    return hash((parent, tokens))


def num_cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence of num_tokens a prefix-cache lookup may
    hit: every full block but one holding its last token, which is always computed so that
    the request samples. The one statement of this rule: the block manager's lookup, the
    stable hashes a replica reports, the router's reading of those reports and the
    simulator's prompt keys all call it."""
    return (num_tokens - 1) // block_size


def cache_namespace(**parts: str | None) -> CacheNamespace:
    """The namespace of a request's cached blocks from its named parts (salt=..., adapter=...):
    b"" when every part is empty or None (the one namespace every plain request shares)."""
    named = [f"{name}={value}" for name, value in sorted(parts.items()) if value]
    return "\x1f".join(named).encode()


def with_adapter(namespace: CacheNamespace, adapter: str | None) -> CacheNamespace:
    """`namespace` (a tenant's, or b"") narrowed to a LoRA adapter's blocks: what
    cache_namespace(salt=..., adapter=...) gives, so the engine and the router, each adding
    the request's adapter to the namespace it was given, agree."""
    if not adapter:
        return namespace
    parts = dict(part.split("=", 1) for part in namespace.decode().split("\x1f") if part)
    return cache_namespace(**{**parts, "adapter": adapter})


def namespaced(namespace: CacheNamespace, tokens: BlockTokens) -> BlockTokens:
    """A chain's first block's key in `namespace`: the tokens themselves in the shared
    namespace, else the tokens tagged with it (a longer bytes object, or a longer tuple, than
    any plain block's key, so no plain key equals it)."""
    if not namespace:
        return tokens
    if isinstance(tokens, bytes):
        return _NAMESPACE_TAG + len(namespace).to_bytes(4, "little") + namespace + tokens
    return (_NAMESPACE_TAG + namespace, *tokens)
