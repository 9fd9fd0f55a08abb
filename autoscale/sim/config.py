"""The simulated cluster's settings (`simulate`'s config)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from iterserve.autoscale.sim.kv_pull import SimKVPulls
from iterserve.autoscale.sim.kv_tiers import SimKVTiers
from iterserve.autoscale.sim.lora import SimLoRA
from iterserve.autoscale.sim.tenancy import SimTenancy
from iterserve.replica.device_idle import WaitDistribution
from iterserve.replica.sim_runner import SimulatorConfig


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
    through pure-decode stretches in one jump (same results; see simulated_replica).

    startup_delay_s from a measurement (loadtests/studies/replica_startup, a start on Ray
    Serve from a request at zero replicas): the sum of its stages but the last,

        startup_delay_s = actor_start + imports + model_config + tokenizer + weights_read
                          + weights_place + kv_cache + graphs + engine_start

    (first_token is left out: the simulator charges every request its own first token; the
    un-timed rest of the start, under 1 %, is in no stage). The default, 30 s, is taken from
    published figures (production-anchors.md: 30-60 s cold starts at min_replicas 0); the
    same value is AutoscaleConfig.startup_s, the policy's look-ahead, when the policy knows
    it.

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

    kv_tiers: where set, each replica has a host KV tier (and a disk tier below it) of
    these sizes and bandwidths: the device's evictions go there, lookups continue there,
    and each step lasts its copies longer (sim/kv_tiers.py).

    kv_pulls: where set, a replica routed a request whose prefix another replica holds
    further (device or host tier) pulls those blocks over a simulated network when that
    beats prefilling them (sim/kv_pull.py; bandwidth and latency are assumptions).

    lora: where set, each replica holds LoRA adapters (device slots, a host LRU) and a step
    whose requests use one not on the device lasts its load longer (sim/lora.py); the
    replicas report the adapters they hold. None: requests' adapters are ignored.

    tenancy: where set, requests carry their tenant's weight and band into the replicas,
    whose waiting queues the engine's own policy orders (fcfs, priority, fair), optionally
    with SLO admission and llm-d-style flow control in front (sim/tenancy.py). None: every
    request is the default tenant's under fcfs, as before.

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
    lazy_private_blocks: bool = True  # see SimBlockManager.mark_private (same results)
    max_virtual_s: float = math.inf  # stop even if requests are unfinished (recorded as such)
    # --- Ray path latency outside the replicas (see the docstring) ---
    dispatch_latency_s: float = 0.0
    stream_latency_s: float = 0.0
    engine_waits: WaitDistribution | None = None  # engine CPU before each continuing step
    router_sync_delay_s: float | None = None
    kv_tiers: SimKVTiers | None = None  # host / disk KV tiers per replica (sim/kv_tiers.py)
    kv_pulls: SimKVPulls | None = None  # KV pulls between replicas (sim/kv_pull.py)
    lora: SimLoRA | None = None  # LoRA adapter slots and load costs per replica (sim/lora.py)
    tenancy: SimTenancy | None = None  # tenants' weights, bands, SLOs; the sharing policy

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
