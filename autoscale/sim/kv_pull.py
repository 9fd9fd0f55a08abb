"""KV pulls between simulated replicas: a receiver fetches a prefix another replica holds.

A request routed to a replica that misses (part of) its prefix, while another replica holds
more of it on its device or in its host tier, may pull those blocks over the network instead
of computing them (LMCache's peer-to-peer sharing, Mooncake's store, Dynamo's NIXL transfers).
The cluster (`cluster.ClusterSim`) asks `KVPulls.plan` at dispatch; the pull then runs as two
events on the virtual clock:

    dispatch ──latency──> holder reads its blocks ──bytes / bandwidth──> blocks land, request
                          (evicted meanwhile: the pull    in the receiver's    arrives at the
                           fails, the request computes)   device cache          receiver

Cost (every number a simulated assumption, `SimKVPulls`): pull_s = pull_latency_s +
tokens x kv_bytes_per_token / network_gb_s. A pull is taken only when it beats the receiver's
prefill of those tokens (`worth_pulling`: tokens x the cost model's per-prefill-token time).
The holder is not stalled: it runs its batch on, its next step lasting the copy of its
device blocks into a send buffer longer (`holder_copy_gb_s`; host-tier blocks are already in
host memory). The pulled blocks land in the receiver's prefix cache as free, findable blocks
(`SimBlockManager.land_blocks`), where its own lookup finds them at admission.

The router's side (`credit_pulls`, pure, in autoscale/kv_pull_cost.py: the live router uses
it too): a replica that holds less of a prompt than the best holder offered is credited
the difference at (1 - its pull cost as a share of prefilling it), as
`kv_tier_costs.charged_hit` credits a host-tier hit: an overloaded holder loses to a lightly
loaded replica plus a pull when that is cheaper than queuing there.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from iterserve.autoscale.sim.prefix import prompt_namespace
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.block_keys import (
    ROOT_HASH,
    BlockHash,
    BlockTokens,
    block_hash,
    block_tokens,
    namespaced,
    num_cacheable_blocks,
)
from iterserve.replica.sim_runner import CostModel

if TYPE_CHECKING:
    from iterserve.autoscale.sim.block_manager import SimBlockManager
    from iterserve.autoscale.sim.simulated_replica import SimulatedReplica

GB = 1e9
R = TypeVar("R", bound=Hashable)

# One block of a prompt's hash chain: (its key, its parent's key, its tokens as keyed).
ChainBlock = tuple[BlockHash, BlockHash, BlockTokens]


@dataclass(frozen=True)
class SimKVPulls:
    """Pulls between replicas (simulated: no network is measured here).

    network_gb_s: the bandwidth of one pull, GB/s (default 12.5: a 100 Gb/s datacenter NIC;
    200 Gb/s is 25). pull_latency_s: each pull's fixed cost before bytes flow, the request
    reaching the holder and its reply starting (default 100 us: a TCP round trip in one
    datacenter; RDMA is ~10 us). holder_copy_gb_s: the holder's copy of its device blocks
    into a send buffer, added to its next step (default 25: pinned memory over PCIe 4.0 x16,
    the host tier's own figure). min_pull_blocks: a smaller gain is not worth a pull."""

    network_gb_s: float = 12.5
    pull_latency_s: float = 1e-4
    holder_copy_gb_s: float = 25.0
    min_pull_blocks: int = 1

    def __post_init__(self) -> None:
        if self.network_gb_s <= 0 or self.holder_copy_gb_s <= 0:
            raise ValueError("network_gb_s and holder_copy_gb_s must be > 0")
        if self.pull_latency_s < 0:
            raise ValueError("pull_latency_s must be >= 0")
        if self.min_pull_blocks < 1:
            raise ValueError("min_pull_blocks must be >= 1")

    def transfer_seconds(self, num_tokens: int, kv_bytes_per_token: int) -> float:
        """The bytes' time on the wire, after the latency."""
        return num_tokens * kv_bytes_per_token / (self.network_gb_s * GB)

    def pull_seconds(self, num_tokens: int, kv_bytes_per_token: int) -> float:
        return self.pull_latency_s + self.transfer_seconds(num_tokens, kv_bytes_per_token)


def worth_pulling(pulls: SimKVPulls, cost: CostModel, num_tokens: int,
                  kv_bytes_per_token: int) -> bool:
    """Does pulling num_tokens beat prefilling them on the receiver (the cost model's
    per-prefill-token time; the step's fixed cost is paid either way)?"""
    return num_tokens > 0 and pulls.pull_seconds(num_tokens, kv_bytes_per_token) \
        < num_tokens * cost.b_s_per_prefill_token


def pull_fraction(pulls: SimKVPulls, num_tokens: int, kv_bytes_per_token: int,
                  prefill_tokens_per_s: float) -> float:
    """A pulled token's cost as a share of prefilling it (1: no cheaper than computing)."""
    if num_tokens <= 0 or prefill_tokens_per_s <= 0:
        return 1.0
    prefill_s = num_tokens / prefill_tokens_per_s
    return min(1.0, pulls.pull_seconds(num_tokens, kv_bytes_per_token) / prefill_s)


def can_ever_run(spec: WorkloadRequest, replica: SimulatedReplica) -> bool:
    """Would the replica's scheduler accept the request (`Scheduler.check_fits`)? A pull
    is planned only for one it will: the request reaches the receiver later."""
    prompt_len = len(spec.prompt_token_ids)
    limit = replica.scheduler_config.max_model_len
    bm = replica.block_manager
    return 0 < prompt_len < limit and bm.num_blocks_for(
        min(prompt_len + spec.max_tokens, limit)) <= bm.num_total_blocks


def prompt_chain(prompt: Sequence[int], block_size: int, num_blocks: int) -> list[ChainBlock]:
    """The first num_blocks blocks of the prompt's hash chain, keyed as the block manager
    keys them (the first block in the prompt's cache namespace)."""
    num_blocks = min(num_blocks, num_cacheable_blocks(len(prompt), block_size))
    chain: list[ChainBlock] = []
    parent = ROOT_HASH
    for i in range(num_blocks):
        chunk = block_tokens(prompt[i * block_size:(i + 1) * block_size])
        if i == 0:
            chunk = namespaced(prompt_namespace(prompt), chunk)
        key = block_hash(parent, chunk)
        chain.append((key, parent, chunk))
        parent = key
    return chain


def sendable_blocks(chain: Sequence[ChainBlock], manager: SimBlockManager) -> int:
    """How many leading blocks of the chain the replica can send now: on its device or in
    its host tier (a disk block would be read first: not pulled)."""
    cached, host = manager.cached_blocks, manager.host
    n = 0
    for key, _, _ in chain:
        if key not in cached and (host is None or key not in host):
            break
        n += 1
    return n


@dataclass(frozen=True)
class PullPlan:
    """One pull: the receiver holds chain[:first] itself and pulls chain[first:] from the
    holder."""

    spec: WorkloadRequest
    receiver: str
    holder: str
    chain: tuple[ChainBlock, ...]
    first: int

    @property
    def num_blocks(self) -> int:
        return len(self.chain) - self.first


class KVPulls:
    """One cluster's pulls: the decisions (`plan`), the two events (`read`, `land`), and
    their counts (`summary`)."""

    def __init__(self, pulls: SimKVPulls, cost: CostModel, kv_bytes_per_token: int,
                 block_size: int) -> None:
        self.pulls = pulls
        self.cost = cost
        self.kv_bytes_per_token = kv_bytes_per_token
        self.block_size = block_size
        self.counts = dict.fromkeys(("considered", "declined", "taken", "failed", "landed_blocks",
                                     "bytes_moved", "wire_seconds", "holder_copy_seconds"), 0.0)

    def plan(self, spec: WorkloadRequest, receiver: SimulatedReplica,
             answers: Mapping[str, Sequence[int]], replicas: Mapping[str, SimulatedReplica]
             ) -> PullPlan | None:
        """The pull for a request routed to receiver, or None (nobody holds more, a pull
        does not beat computing, or the request can never run there: it is rejected as
        without pulls). answers: per replica holding some of the prompt, its leading tokens
        per KV tier (device, host, disk; or the device alone), the cluster's cache answers;
        the best candidate's are checked exactly here. replicas: those that may send."""
        if not can_ever_run(spec, receiver):
            return None
        mine = answers.get(receiver.replica_id, ())
        own = sum(mine)  # its own lookup reaches every tier
        candidates = [(sum(counts[:2]), rid) for rid, counts in answers.items()
                      if rid != receiver.replica_id and rid in replicas]
        if not candidates:
            return None
        estimate, holder = max(candidates)
        size = self.block_size
        first = own // size
        if estimate // size - first < self.pulls.min_pull_blocks:
            return None
        self.counts["considered"] += 1
        chain = prompt_chain(spec.prompt_token_ids, size, estimate // size)
        sendable = sendable_blocks(chain, replicas[holder].block_manager)
        tokens = (sendable - first) * size
        if sendable - first < self.pulls.min_pull_blocks or not worth_pulling(
                self.pulls, self.cost, tokens, self.kv_bytes_per_token):
            self.counts["declined"] += 1
            return None
        return PullPlan(spec, receiver.replica_id, holder, tuple(chain[:sendable]), first)

    def read(self, plan: PullPlan, holder: SimulatedReplica | None) -> float | None:
        """The holder reads the blocks (latency after dispatch): the seconds they take on
        the wire, or None if it no longer holds them all (failed: the request computes).
        The holder's copy of its device blocks lengthens its next step; it is not stalled."""
        manager = holder.block_manager if holder is not None else None
        if manager is None or sendable_blocks(plan.chain, manager) < len(plan.chain):
            self.counts["failed"] += 1
            return None
        on_device = sum(1 for key, _, _ in plan.chain[plan.first:] if key in manager.cached_blocks)
        block_bytes = self.kv_bytes_per_token * self.block_size
        copy_s = on_device * block_bytes / (self.pulls.holder_copy_gb_s * GB)
        if holder.wake_time is not None:  # mid-batch: its next step copies them out
            holder.served_pull_seconds += copy_s
        self.counts["holder_copy_seconds"] += copy_s
        self.counts["taken"] += 1
        self.counts["bytes_moved"] += plan.num_blocks * block_bytes
        wire = self.pulls.transfer_seconds(plan.num_blocks * self.block_size,
                                           self.kv_bytes_per_token)
        self.counts["wire_seconds"] += wire
        return wire

    def land(self, plan: PullPlan, receiver: SimulatedReplica) -> None:
        """The blocks reach the receiver's device cache (as many as its free blocks take)."""
        self.counts["landed_blocks"] += receiver.block_manager.land_blocks(plan.chain)

    def summary(self) -> dict[str, float]:
        return dict(self.counts)
