"""What a prefix costs where it lives: the router's price for a token in each KV tier.

The router's score charges a prompt's uncached tokens as prefill work (router_policy's
`prefill` term, in tokens). A token a replica holds in its device KV costs nothing; one in
a tier below it (host memory, local disk) costs the time to copy its KV back, which the
score counts in the same unit, prefill tokens:

    fraction(t) = min(1, kv_bytes_per_token / bandwidth(t)  /  (1 / prefill rate))

the copy seconds of one token over the prefill seconds of one token, the prefill rate being
the replica's own measured `prefill_token_rate` (RouterConfig.prefill_tokens_per_s where it
reports none). Capped at 1: a tier slower than computing is charged as computing. A
replica's cached prefix then weighs sum over its blocks of block_size x (1 - fraction(tier
of the block)) tokens (`charged_hit`), what `KVRouterCore` takes as its `cached_tokens`.
With RouterConfig.score_kv_tiers off the router is blind to the tiers: only the device's
blocks count (`tier_fractions` is not asked).

Defaults (RouterConfig): host 25 GB/s, disk 6 GB/s, 128 KiB a token (Llama-3-8B bf16),
34k prefill tokens/s: a host token costs 0.18 of a prefill token, a disk token 0.73.
"""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.replica.block_hashes import DISK, HOST, KV_TIERS

GB = 1e9


def tier_fractions(load: ReplicaLoad | None, config: RouterConfig) -> tuple[float, ...]:
    """Per tier of KV_TIERS, what one token read from there costs as a share of prefilling
    it on this replica (device 0)."""
    rate = load.prefill_token_rate if load is not None and load.prefill_token_rate > 0 \
        else config.prefill_tokens_per_s
    bandwidth = {HOST: config.host_kv_read_gb_s, DISK: config.disk_kv_read_gb_s}
    token_bytes = kv_bytes_per_token(load, config)
    return tuple(0.0 if tier not in bandwidth else
                 min(1.0, token_bytes * rate / (bandwidth[tier] * GB))
                 for tier in KV_TIERS)


def kv_bytes_per_token(load: ReplicaLoad | None, config: RouterConfig) -> int:
    """The KV bytes of one token on this replica: what it reports, else the config's
    assumption (a replica that reports none: the simulator's, an older one)."""
    if load is not None and load.kv_bytes_per_token > 0:
        return load.kv_bytes_per_token
    return config.kv_bytes_per_token


def charged_hit(tokens_per_tier: Sequence[int], fractions: Sequence[float]) -> int:
    """A cached prefix's worth in prefill tokens saved: tokens_per_tier[i] tokens read from
    tier KV_TIERS[i] save (1 - fractions[i]) of their prefill each."""
    return round(sum(tokens * (1.0 - fraction)
                     for tokens, fraction in zip(tokens_per_tier, fractions, strict=False)))
