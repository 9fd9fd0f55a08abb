"""A replica pulls a prompt's cached prefix from the replica that holds it, through Ray's
object store, instead of computing it (the transfer itself: replica/kv_transfer.py).

    router (autoscale/router.py)   writes a hint into the request: the replica whose report
                                   holds the longest prefix of the prompt, and how many tokens
    receiver (`KVPuller.pull`)     counts the prefix it holds itself; when the holder's is
                                   longer by enough that a pull beats computing
                                   (autoscale/kv_pull_cost.py), it calls the holder's
                                   `export_kv_blocks` through a handle to its own deployment
                                   with `route_to_replica` naming the holder (the router ranks
                                   only that replica), within `timeout_s`
    holder (`export_chunks`)       copies the blocks off its engine thread without waiting
                                   for a step where it can (CPU: the whole pull in one
                                   chunk), else between two of its steps, a chunk of at most
                                   CHUNK_BYTES at a time; and `ray.put`s each chunk
    receiver                       reads the chunks' refs and imports each into its host tier,
                                   from where the engine's onboarding copies them to the device

Anything short of success (a timeout, a holder that died, evicted the blocks, or runs another
layout, a pull bigger than `max_bytes`) leaves the request to compute its prefix. A holder
that is gone fails at once, not at the timeout: the router refuses a call naming a replica it
no longer runs (RouteTargetGone), and a holder dying under the call raises ActorDiedError: a pull only
ever adds blocks whose stable hashes match the prompt, so it cannot change a token. Every
pull's outcome is counted (`kv_pulls{outcome}`, `kv_pull_bytes`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, RayError
from ray.serve.exceptions import RayServeException

from iterserve.autoscale.kv_pull_cost import BandwidthMeter, pull_beats_compute
from iterserve.autoscale.route_target_gone import RouteTargetGone
from iterserve.replica.block_keys import CacheNamespace
from iterserve.replica.errors import EngineError
from iterserve.replica.kv_transfer import (
    KVBlockPayload,
    KVTransferRefused,
    can_export_unlocked,
    export_blocks,
    export_blocks_unlocked,
    import_blocks,
    layout_key,
    num_held_blocks,
    prompt_chain,
)

logger = logging.getLogger(__name__)

# The most bytes the holder copies between two of its steps: its batch waits for one
# chunk's copy at a time (~10 ms at memory speed), however long the prefix. A copy off the
# engine thread (CPU) takes the whole pull at once: one copy, one put, one import.
CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class KVPullConfig:
    """mode: off, on (pull when the cost rule says it beats computing), always (whenever the
    holder has more: to measure the pull itself); max_bytes: the most KV one pull may move
    (more: only the leading max_bytes are pulled, the rest computed); timeout_s: the most a
    pull may add to the request's time to first token before it gives up and computes."""

    mode: str = "off"
    max_bytes: int = 64 * 2**20
    timeout_s: float = 2.0


@dataclass(frozen=True)
class PullHint:
    holder: str
    cached_tokens: int

    @classmethod
    def parse(cls, hint: object) -> PullHint | None:
        """The router's hint as it crossed the handle, or None when absent or malformed."""
        if (isinstance(hint, (tuple, list)) and len(hint) == 2 and isinstance(hint[0], str)
                and isinstance(hint[1], int)):
            return cls(hint[0], hint[1])
        return None


@dataclass
class ExportTimes:
    """The holder's side of the pulls it served: calls, and seconds per phase (copying blocks
    off the engine thread, finishing a chunk between two steps, putting chunks into the object
    store), for info(): with the puller's own phases they split a pull's time."""

    calls: int = 0
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("copy", "step_boundary", "put"), 0.0))

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now


async def export_chunks(engine: Any, token_ids: Sequence[int], namespace: CacheNamespace,  # noqa: ANN401
                        first_block: int, max_bytes: int,
                        times: ExportTimes | None = None) -> list[ray.ObjectRef]:
    """The holder's side: the prompt's blocks from first_block on, at most max_bytes, as
    object refs of KVBlockPayload chunks, each put into the object store off the engine
    thread. Where the engine allows (kv_transfer.can_export_unlocked: CPU, no async
    scheduling) the blocks are copied off the engine thread too, without waiting for a step
    boundary, in one chunk, each block checked against the writes planned meanwhile; a copy
    that ends short there (a block being written) is finished between two steps, a chunk of
    at most CHUNK_BYTES at a time. Elsewhere every chunk is copied on the engine thread
    between two steps. Empty: it holds none of them."""
    times = times if times is not None else ExportTimes()
    times.calls += 1
    unlocked = can_export_unlocked(engine.engine)
    refs: list[ray.ObjectRef] = []
    sent = 0
    clock = time.perf_counter()
    while sent < max_bytes:
        budget = min(CHUNK_BYTES, max_bytes - sent)
        payload: KVBlockPayload | None = None
        ref: ray.ObjectRef | None = None
        if unlocked:  # the batch never waits for this copy: the whole rest in one chunk,
            budget = max_bytes - sent  # copied and put in one trip to a thread
            payload, ref = await asyncio.to_thread(_copy_unlocked_and_put, engine.engine,
                                                   token_ids, namespace, first_block, budget,
                                                   times)
            clock = time.perf_counter()
        if payload is None or _ends_short(payload, budget):
            # between two steps the batch waits: at most one chunk's copy beyond the head
            budget = min(budget, (payload.nbytes if payload is not None else 0) + CHUNK_BYTES)
            payload = await _export_at_step_boundary(engine, token_ids, namespace,
                                                     first_block, budget, payload)
            clock = times.add("step_boundary", clock)
        if payload is None or payload.num_blocks == 0:
            break
        if ref is None:
            ref = await asyncio.to_thread(ray.put, payload)
            clock = times.add("put", clock)
        refs.append(ref)
        sent += payload.nbytes
        first_block += payload.num_blocks
        if _ends_short(payload, budget):
            break  # the chain ended here: asking again would only wait for another step
    return refs


def _copy_unlocked_and_put(engine: Any, token_ids: Sequence[int],  # noqa: ANN401
                           namespace: CacheNamespace, first_block: int, budget: int,
                           times: ExportTimes) -> tuple[KVBlockPayload, ray.ObjectRef | None]:
    """export_blocks_unlocked's chunk, and its ref once put when it is whole (a chunk that
    ends short is finished between two steps first)."""
    clock = time.perf_counter()
    payload = export_blocks_unlocked(engine, token_ids, namespace, first_block, budget)
    clock = times.add("copy", clock)
    if payload.num_blocks == 0 or _ends_short(payload, budget):
        return payload, None
    ref = ray.put(payload)
    times.add("put", clock)
    return payload, ref


def _ends_short(payload: KVBlockPayload, budget: int) -> bool:
    return payload.num_blocks < budget // payload.layout.bytes_per_block


async def _export_at_step_boundary(engine: Any, token_ids: Sequence[int],  # noqa: ANN401
                                   namespace: CacheNamespace, first_block: int, budget: int,
                                   head: KVBlockPayload | None) -> KVBlockPayload | None:
    """The chunk copied on the engine thread between two steps; `head`: the blocks the
    unlocked copy already took from first_block on, the rest appended to them."""
    start = first_block + (head.num_blocks if head is not None else 0)
    left = budget - (head.nbytes if head is not None else 0)
    tail: KVBlockPayload | None = await engine.call(
        lambda e: export_blocks(e, token_ids, namespace, start, left))
    if head is None or head.num_blocks == 0:
        return tail
    if tail is None or tail.num_blocks == 0:
        return head
    return KVBlockPayload(head.layout, namespace, first_block,
                          head.stable_hashes + tail.stable_hashes,
                          np.concatenate((head.kv, tail.kv)))


@dataclass
class KVPuller:
    """The receiver's side, one per replica. `export_call(holder, token_ids, namespace,
    first_block, max_bytes)` reaches the holder's export_kv_blocks and returns its refs;
    `record(outcome, nbytes)` counts each pull."""

    engine: Any
    config: KVPullConfig
    replica_id: str
    export_call: Callable[..., Any]
    record: Callable[[str, int], None]
    bandwidth: BandwidthMeter = field(default_factory=BandwidthMeter)
    outcomes: dict[str, int] = field(default_factory=dict)  # pulls by outcome, for info()
    bytes_received: int = 0
    tokens_received: int = 0
    # Seconds spent per phase of the pulls: hashing the prompt and counting the blocks held
    # here, the holder's export call (until its refs), reading the chunks out of the object
    # store, importing them on this engine's thread.
    phase_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("lookup", "export", "fetch", "import"), 0.0))
    _prefill_rate: float | None = None

    async def pull(self, token_ids: Sequence[int], namespace: CacheNamespace,
                   hint: PullHint | None) -> str | None:
        """Pull what the hint's holder has beyond this replica's own prefix, when it pays;
        the outcome counted, or None when there is nothing to consider."""
        if self.config.mode == "off" or hint is None or hint.holder == self.replica_id:
            return None
        layout = layout_key(self.engine.engine)
        if layout is None or self.engine.engine.block_manager.host is None:
            return None
        clock = time.perf_counter()
        chain = prompt_chain(token_ids, namespace, layout.block_size)
        try:
            held = await self.engine.call(lambda e: num_held_blocks(e, chain))
        except EngineError:  # a dead engine: the request itself reports it, no pull
            return None
        self._phase("lookup", clock)
        missing = min(len(chain), hint.cached_tokens // layout.block_size) - held
        if missing <= 0:
            return None
        outcome, nbytes = await self._pull_missing(token_ids, namespace, held, missing,
                                                   layout.bytes_per_block, layout.block_size,
                                                   hint.holder)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.bytes_received += nbytes
        self.tokens_received += nbytes // layout.bytes_per_block * layout.block_size
        self.record(outcome, nbytes)
        return outcome

    def _prefill_tokens_per_s(self) -> float | None:
        rate = self.engine.stats().prefill_token_rate
        if rate > 0:
            self._prefill_rate = rate  # an idle replica reports 0: keep the last measured
        return self._prefill_rate

    async def _pull_missing(self, token_ids: Sequence[int], namespace: CacheNamespace,
                            held: int, missing: int, bytes_per_block: int, block_size: int,
                            holder: str) -> tuple[str, int]:
        num_blocks = min(missing, self.config.max_bytes // bytes_per_block)
        if num_blocks <= 0:
            return "too_big", 0
        if self.config.mode != "always" and not pull_beats_compute(
                num_blocks * block_size, num_blocks * bytes_per_block,
                self.bandwidth.bytes_per_s, self._prefill_tokens_per_s()):
            return "not_worth", 0
        start = time.monotonic()
        try:
            taken, nbytes = await asyncio.wait_for(
                self._fetch_and_import(token_ids, namespace, held, num_blocks * bytes_per_block,
                                       holder), self.config.timeout_s)
        except asyncio.TimeoutError:
            return "timeout", 0
        except (RouteTargetGone, ActorDiedError) as error:
            logger.info("a pull from %s found it gone, computing instead: %r", holder, error)
            return "holder_gone", 0
        except KVTransferRefused as error:
            logger.warning("a pull from %s refused: %s", holder, error)
            return "refused", 0
        except (RayError, RayServeException, OSError, EngineError) as error:
            # a holder unreachable for now, a full object store, this engine stopped
            logger.info("a pull from %s failed, computing instead: %r", holder, error)
            return "failed", 0
        self.bandwidth.record(nbytes, time.monotonic() - start)
        if taken == 0:
            return "evicted", 0
        return ("pulled" if taken >= min(missing, num_blocks) else "partial"), nbytes

    async def _fetch_and_import(self, token_ids: Sequence[int], namespace: CacheNamespace,
                                first_block: int, max_bytes: int, holder: str
                                ) -> tuple[int, int]:
        """(blocks imported, bytes received): each chunk imported as it arrives, so a pull
        cut short keeps the leading blocks that did arrive."""
        clock = time.perf_counter()
        refs = await self.export_call(holder, list(token_ids), namespace, first_block,
                                      max_bytes)
        clock = self._phase("export", clock)
        taken = nbytes = 0
        for ref in refs:
            payload: KVBlockPayload = await ref
            clock = self._phase("fetch", clock)
            taken += await self.engine.call(
                lambda e, chunk=payload: import_blocks(e, token_ids, namespace, chunk))
            clock = self._phase("import", clock)
            nbytes += payload.nbytes
        return taken, nbytes

    def _phase(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_seconds[phase] += now - since
        return now
