"""What the cluster simulator takes and gives back: requests, settings, records, results.

`SimRequest` is the simulator's own request type (the library never imports `loadtests/`,
whose workload generators and trace reader produce these). Everything is plain data and
JSON-able, so a result can be compared byte for byte (`SimResult.to_json`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from iterserve.autoscale.percentile import percentile, percentile_of_counts
from iterserve.replica.device_idle import WaitDistribution
from iterserve.replica.sim_runner import SimulatorConfig


class SyntheticPrompt(Sequence):
    """A prompt that costs no memory until a replica runs it: a shared prefix (a tuple
    held by reference, e.g. a tenant's context) followed by `num_unique` tokens that no
    other prompt has (ids unique_start, unique_start + 1, ...; pick disjoint ranges).

    Hundreds of thousands of queued requests would otherwise hold their token lists for the
    whole run. Iterating, slicing and len() are C-speed (itertools / range). A simulated
    replica's `Request` holds it as its prompt_token_ids, in place of the list (the block
    manager reads the prompt from `packed` bytes; see SimReplica.add), so it answers as that
    list does: slices are lists, and `prompt + outputs` is a list.

    private: no other request's prompt holds any of its own tokens (not even inside
    another prompt's prefix, as a chat's next turn holds this one), so no other request can
    find its cache blocks from the first one holding an own token on: the simulated replica
    hashes those blocks only if the request is preempted (`BlockManager.mark_private`).
    """

    __slots__ = ("prefix", "unique_start", "num_unique", "private")

    def __init__(self, prefix: tuple[int, ...], unique_start: int, num_unique: int,
                 private: bool = False) -> None:
        if num_unique < 0:
            raise ValueError("num_unique must be >= 0")
        self.prefix = prefix
        self.unique_start = unique_start
        self.num_unique = num_unique
        self.private = private

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
            return (self.prefix, self.unique_start, self.num_unique) == (
                other.prefix, other.unique_start, other.num_unique)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.prefix, self.unique_start, self.num_unique))

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


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload: when it arrives, its prompt, how many tokens it generates.

    output_token_id: the token the simulated model emits at every output position. A
    multi-turn workload puts `[output_token_id] * max_tokens` of turn k into the prompt of
    turn k + 1, so that the replica's prefix cache can hold the whole conversation, as it
    would with the real model's answer.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: Sequence[int]  # a tuple, or a SyntheticPrompt
    max_tokens: int
    session_id: str | None = None
    output_token_id: int = 1

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens must be >= 1")
        if not self.prompt_token_ids:
            raise ValueError(f"{self.request_id}: the prompt is empty")
        if self.arrival_time < 0 or math.isnan(self.arrival_time):
            raise ValueError(f"{self.request_id}: arrival_time must be >= 0")


@dataclass(frozen=True)
class ClusterSimConfig:
    """The simulated cluster. Defaults: Llama-3-8B on H100s behind Ray Serve (see fields).

    Engine (per replica, the production Scheduler + BlockManager): max_num_seqs,
    max_num_batched_tokens, block_size, max_model_len, num_blocks (None: what the simulated
    GPU's memory leaves after weights, as `SimulatedRunner.num_kv_blocks` computes it).
    Serve: routing_stats_period_s (routers see stats this old), max_ongoing_requests (a
    replica at this many in flight is skipped; with none free the request waits at its
    router), metrics_push_interval_s and look_back_period_s (the autoscaler sees the mean
    over the window), autoscale_interval_s (the controller's loop), startup_delay_s (scale
    decision to serving: model load, compile, warm-up). fast_forward: advance replicas
    through pure-decode stretches in one jump (same results; see cluster_sim_replica).

    Ray path latency outside the replicas (0: none; measure them with
    loadtests/ray_path_latency): dispatch_latency_s from the router's choice to the replica
    receiving the request (handle routing, actor call), stream_latency_s from a token
    leaving the engine to the client (the streaming hop back). Both are constants paid by
    every request alike, so every replica sees the same arrival process shifted by
    dispatch_latency_s: they are applied as a shift of each request's client-side times
    (first_token, finish; ClusterSim._complete). Left out: routers here see a replica's
    stats and completions that many milliseconds sooner than on the real path (against a
    routing-stats period of hundreds).

    router_sync_delay_s: where set, every router hears of the others' sends and completions
    this long after them (Dynamo's router replica sync; the routers must be
    `PeerSyncedPolicy`); None, as on Ray Serve, routers share nothing.

    engine_waits: where set, every step that follows its replica's previous step at once
    lasts the cost model's time plus a wait drawn from it (the engine's own CPU time,
    measured in a Ray run by the replicas' DeviceIdleMeter), from the replica's own seeded
    stream.
    """

    sim: SimulatorConfig = field(default_factory=SimulatorConfig)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    max_model_len: int = 8192
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    routing_stats_period_s: float = 0.5
    max_ongoing_requests: int = 512
    metrics_push_interval_s: float = 0.5
    look_back_period_s: float = 2.0
    autoscale_interval_s: float = 0.1
    startup_delay_s: float = 30.0
    seed: int = 0
    fast_forward: bool = True
    lazy_private_blocks: bool = True  # see BlockManager.mark_private (same results)
    max_virtual_s: float = math.inf  # stop even if requests are unfinished (recorded as such)
    # --- Ray path latency outside the replicas (see the docstring) ---
    dispatch_latency_s: float = 0.0
    stream_latency_s: float = 0.0
    engine_waits: WaitDistribution | None = None  # engine CPU before each continuing step
    router_sync_delay_s: float | None = None

    def __post_init__(self) -> None:
        positive = ("routing_stats_period_s", "metrics_push_interval_s", "look_back_period_s",
                    "autoscale_interval_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.startup_delay_s < 0:
            raise ValueError("startup_delay_s must be >= 0")
        if self.router_sync_delay_s is not None and self.router_sync_delay_s < 0:
            raise ValueError("router_sync_delay_s must be >= 0 (or None)")
        if self.dispatch_latency_s < 0 or self.stream_latency_s < 0:
            raise ValueError("dispatch_latency_s and stream_latency_s must be >= 0")
        if self.max_ongoing_requests < 1 or self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError("max_ongoing_requests, max_num_seqs and block_size must be >= 1")


@dataclass(slots=True)
class RequestRecord:
    """One request's fate. Times are virtual seconds; None where it never got that far."""

    request_id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    router: int
    replica: str | None = None
    routed: float | None = None
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the replica's prefix cache
    preemptions: int = 0
    itl_max: float = 0.0  # the longest gap between two of its tokens
    itl_p99: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class SimResult:
    """Everything `simulate` measured.

    replicas_over_time: (t, running, starting, draining) at every change. gpu_seconds:
    replica-seconds from scale decision to stop (a starting GPU is paid for). itl_counts:
    every inter-token gap of every request, rounded to cluster_sim_itl.ITL_RESOLUTION_S, as {gap: count}.
    """

    records: list[RequestRecord]
    replicas_over_time: list[tuple[float, int, int, int]]
    gpu_seconds: float
    end_time: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    itl_counts: dict[float, int]
    num_steps: int
    router_names: list[str]
    autoscaler_name: str | None

    # ------------------------------------------------------------------- summaries
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.records if r.ttft is not None]

    def ttft_percentile(self, q: float) -> float:
        return percentile(self.ttfts(), q)

    def itl_percentile(self, q: float) -> float:
        return percentile_of_counts(self.itl_counts, q)

    @property
    def num_finished(self) -> int:
        return sum(1 for r in self.records if r.done)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens \
            else 0.0

    def throughput(self) -> float:
        """Output tokens per second, first arrival to last finish."""
        done = [r for r in self.records if r.done]
        if not done:
            return 0.0
        span = max(r.finish for r in done) - min(r.arrival for r in self.records)
        return sum(r.output_tokens for r in done) / span if span > 0 else math.inf

    def goodput(self, ttft_slo_s: float, itl_slo_s: float) -> float:
        """Requests per second that finished with TTFT and their own p99 ITL within the SLO."""
        if not self.records:
            return 0.0
        good = sum(1 for r in self.records if r.done and r.ttft <= ttft_slo_s
                   and r.itl_p99 <= itl_slo_s)
        span = max(self.end_time - min(r.arrival for r in self.records), 1e-9)
        return good / span

    def summary(self) -> dict[str, Any]:
        return {
            "routers": self.router_names,
            "autoscaler": self.autoscaler_name,
            "requests": len(self.records),
            "finished": self.num_finished,
            "ttft_p50_s": self.ttft_percentile(50),
            "ttft_p99_s": self.ttft_percentile(99),
            "itl_p99_s": self.itl_percentile(99),
            "throughput_tok_s": self.throughput(),
            "preemptions": sum(r.preemptions for r in self.records),
            "prefix_hit_rate": self.prefix_hit_rate,
            "gpu_hours": self.gpu_seconds / 3600.0,
            "end_time_s": self.end_time,
            "engine_steps": self.num_steps,
        }

    def to_json(self) -> str:
        """Canonical JSON of the whole result: equal runs give equal strings."""
        data = {
            "summary": self.summary(),
            "records": [asdict(r) for r in self.records],
            "replicas_over_time": self.replicas_over_time,
            "itl_counts": sorted(self.itl_counts.items()),
        }
        return json.dumps(data, sort_keys=True)

