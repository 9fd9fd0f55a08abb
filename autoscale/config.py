"""Thresholds of the KV-aware router and the autoscaler, with documented defaults.

pydantic at the edge: these two models are what Serve options, YAML and CLI flags turn into.
They are frozen and JSON-serialisable (`model_dump()`), because Ray passes the router's
settings through `RequestRouterConfig.request_router_kwargs` and the policy's through
`AutoscalingPolicy.policy_kwargs`, both of which must be plain JSON.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RouterConfig(BaseModel):
    """How the KV-aware router orders replicas (router_policy.py's docstring has the score;
    the README's "RouterConfig" section, the table of these fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    # The served model's name: the `model_name` label of the router's metrics.
    model_name: str = "iterserve"
    # deploy/kv_pull.py: set from AppArgs.kv_pull, the one switch of prefix pulls.
    kv_pull_hints: bool = Field(
        False, description="write into each generate call which replica holds the longest "
        "prefix of its prompt, so the replica it lands on may pull that prefix from there.")
    kv_high_watermark: float = Field(
        0.90, gt=0.0, le=1.0,
        description="KV usage at or above which a replica is 'hot' and ranked last.",
    )
    max_waiting_per_replica: int | None = Field(
        None, ge=1,
        description="A replica with this many waiting requests is 'full' and ranked last; "
        "None uses the replica's own max_waiting_requests (or never, if unbounded).",
    )
    waiting_weight: float = Field(
        1.0, ge=0.0,
        description="Score weight of one waiting request (in units of 'whole KV caches').",
    )
    kv_weight: float = Field(
        1.0, ge=0.0, description="Score weight of KV usage in [0, 1].",
    )
    inflight_kv_per_request: float = Field(
        0.02, ge=0.0,
        description="KV usage added to a replica's stale kv_usage for each request this "
        "router sent it since its last stats update (until it sees the request complete).",
    )
    use_committed_kv: bool = Field(
        True,
        description="Score KV as max(kv_usage, KV committed by this router's in-flight "
        "requests: prompt + max_tokens each), which sees growth before it happens.",
    )
    stats_stale_after_s: float = Field(
        5.0, gt=0.0,
        description="Stats older than this rank the replica after fresh ones (tier 1), "
        "scored on its last stats plus everything routed to it since.",
    )
    prefix_affinity: bool = Field(
        True, description="Send prompts sharing their first blocks to the same replica.",
    )
    prefix_block_size: int = Field(
        16, ge=1, description="Tokens per block hashed for affinity (match the KV block size).",
    )
    prefix_num_blocks: int = Field(
        4, ge=1,
        description="How many leading full blocks make the affinity key; prompts shorter "
        "than one block get no affinity.",
    )
    prefix_max_entries: int = Field(
        10_000, ge=1, description="Affinity table size (LRU) per router.",
    )
    prefix_affinity_slack: float = Field(
        0.5, ge=0.0,
        description="Affinity holds while the preferred replica's score is within this "
        "much of the best replica's score; beyond it load wins over cache reuse.",
    )
    score_prefill_work: bool = Field(
        True,
        description="Add the prefill work a replica faces before this request's first "
        "token to its score: prompt tokens of requests routed since its last stats, plus "
        "this prompt's tokens the replica does not hold in its prefix cache (when the "
        "caller knows the replica's cache: its cache report).",
    )
    prefill_tokens_per_waiting: float = Field(
        512.0, gt=0.0,
        description="Prefill tokens that weigh as much as one waiting request in the score "
        "(512: ~15 ms of H100 prefill for an 8B model; tournament sweeps over 3 seeds: "
        "256-1024 ahead of 2048-4096; 512 ahead of 1024 on multi-tenant).",
    )
    routed_work_weight: float = Field(
        32.0, ge=0.0,
        description="Score weight of the prefill tokens this router sent each replica "
        "recently (decayed, above the least-sent replica), in prefill_tokens_per_waiting "
        "units, scaled down by the share of the prompt some replica caches: balances work "
        "the stale stats cannot show yet, as Ray's and SGLang's 'smallest tree' does. "
        "0 disables. (Tournament sweeps, 3 seeds: 32 ahead of 8 on steady, diurnal, "
        "chat-summarise; 64 no better.)",
    )
    cache_affinity_threshold: float = Field(
        0.1, ge=0.0,
        description="With the replicas' own cache answers: a replica caching at least this "
        "share of the prompt (Ray's match_rate_threshold, 0.1) goes first while in tier 0 "
        "and within cache_affinity_slack of the best score; where none does, the replica "
        "the affinity table last sent the prompt's prefix to (above 1: off).",
    )
    cache_affinity_slack: float = Field(
        3.0, ge=0.0,
        description="How much worse a replica holding the prompt's prefix may score, in "
        "waiting-request units and not counting the routed-work balance, and still be "
        "chosen for it (tournament sweep 1-16 over 3 seeds: 3-4 best on multi-turn and "
        "multi-tenant, 3 ahead on multi-tenant; 1-2 lose sessions to the balance, 8-16 "
        "pile tenants up).",
    )
    lora_affinity_slack: float = Field(
        8.0, ge=0.0,
        description="A request for a LoRA adapter goes to a replica running it, else holding "
        "it with a slot free, among the replicas waiting at most this many requests more "
        "than the least waiting one; beyond, load wins and one of those reads the adapter, "
        "so a hot adapter spreads (autoscale/lora_affinity.py; the tournament's LoRA cell "
        "at 8 replicas, seed 0: p99 TTFT 0.243 s at 8, 0.245 s at 16).",
    )
    lora_traffic_half_life_s: float = Field(
        5.0, gt=0.0,
        description="Half-life of the router's count of the requests it routed per LoRA "
        "adapter; an adapter whose share of them needs more replicas than hold it (its rate "
        "per holder above a replica's share of the cluster's) spreads to one more "
        "(autoscale/lora_traffic.py). 5 s: the routed-work meter's, so the router's two "
        "memories of its own sends forget alike; a popularity shift is followed within "
        "seconds, and at the tournament's 32-replica rate each of its two routers holds a "
        "decayed count of ~60 requests for an adapter with one replica's share.",
    )
    drain_inflight_prefill: bool = Field(
        True,
        description="Count the prefill queued at a replica as the prompt tokens it reported "
        "queued (queued_prefill_tokens) plus those routed to it since its stats, drained "
        "at its reported prefill_token_rate, instead of counting the routed ones in full "
        "until its next stats: at low load most of them are prefilled long before then, "
        "and charging them in full sends both ingress routers to whichever replica "
        "reported last (tournament: 5 floor misses -> 3, p99 TTFT 0.975x geometric mean "
        "over 60 cells, 0.64-1.07x). Replicas that report no rate are charged as with "
        "this off.",
    )
    drain_inflight_waiting: bool = Field(
        False,
        description="With drain_inflight_prefill: count as waiting only the unseen requests "
        "still in the drained prefill queue (as of the last of them), not every request "
        "sent since the replica's stats. Off by default: neutral with two independent "
        "ingress routers (tournament cells at 8 and 32 replicas, 3 seeds: p99 TTFT 0.999x "
        "geometric mean); with router sync (each router counting the other's sends) it is "
        "what keeps sessions on their replicas (multi-turn p99 1.3x without it).",
    )
    router_sync_period_s: float | None = Field(
        None, gt=0.0, le=1.0,
        description="KVAwareRouter: every this many seconds, exchange this router's sends "
        "and completions with the deployment's other routers (one per ingress replica) "
        "through a named Ray actor, and count theirs in flight as its own (Dynamo's "
        "router_replica_sync). None: the routers share nothing. Simulated at 0.01-0.05 s "
        "with drain_inflight_waiting: p99 TTFT 0.98x over the tournament cells, the "
        "multi-tenant herding gap closed; without drain_inflight_waiting, multi-turn 1.2x "
        "worse (loadtests/results/router_arms/).",
    )
    use_replica_cache_reports: bool = Field(
        True,
        description="KVAwareRouter: read the prefix-cache block hashes the replicas report "
        "with their routing stats, and rank with each replica's cached share of the prompt "
        "(cached_tokens); off, the affinity table of recent routes stands in for it.",
    )
    score_kv_tiers: bool = Field(
        True,
        description="Charge the prompt tokens a replica holds below its device KV (its "
        "reported host and disk tiers) their copy time instead of their prefill: a token "
        "in tier t costs min(1, kv_bytes_per_token x the replica's prefill_token_rate / t's "
        "bandwidth) of an uncached token (kv_tier_costs.py). Off: those tokens count as "
        "uncached, as a router reading device-only KV events does (LMCache behind Ray's "
        "router: the tier-blind arm of the tournament).",
    )
    host_kv_read_gb_s: float = Field(
        25.0, gt=0.0,
        description="Assumed host-to-device copy bandwidth of a replica's host KV tier, GB/s "
        "(25: pinned memory over PCIe 4.0 x16, the common H100 host link; an assumption, "
        "not measured here).",
    )
    disk_kv_read_gb_s: float = Field(
        6.0, gt=0.0,
        description="Assumed read bandwidth of a replica's disk KV tier into the device, "
        "GB/s (6: one PCIe 4.0 NVMe drive's sequential read; an assumption, not measured).",
    )
    kv_bytes_per_token: int = Field(
        131072, ge=1,
        description="KV bytes per token assumed for a replica that reports none (replicas "
        "report their own cache's; the simulator's do not), for the tiers' and pulls' copy "
        "times (131072: Llama-3-8B in bf16, 2 x 32 layers x 8 KV heads x 128 x 2 B).",
    )
    prefill_tokens_per_s: float = Field(
        34000.0, gt=0.0,
        description="Prefill speed assumed for a replica that reports no prefill_token_rate, "
        "for the tiers' costs (34k: an 8B model on an H100, as prefill_tokens_per_waiting "
        "assumes and the simulator's cost model computes).",
    )
    routed_work_half_life_s: float = Field(
        5.0, gt=0.0, description="Half-life of the routed-work meter.",
    )
    routing_stats_period_s: float = Field(
        0.5, gt=0.0, le=1.0,
        description="RequestRouterConfig.request_routing_stats_period_s: how often Serve "
        "polls record_routing_stats (Serve's default, 10 s, is far too stale).",
    )
    routing_stats_timeout_s: float = Field(
        2.0, gt=0.0, description="RequestRouterConfig.request_routing_stats_timeout_s.",
    )

    @model_validator(mode="after")
    def _check_drains(self) -> RouterConfig:
        if self.drain_inflight_waiting and not self.drain_inflight_prefill:
            raise ValueError("drain_inflight_waiting counts what is left of the drained "
                             "prefill queue: it needs drain_inflight_prefill")
        if self.router_sync_period_s is not None and not self.drain_inflight_waiting:
            raise ValueError("router_sync_period_s needs drain_inflight_waiting: without it "
                             "every heard send counts as waiting until the replica's next "
                             "stats (simulated: multi-turn p99 1.2x worse)")
        return self


class AutoscaleConfig(BaseModel):
    """When `desired_replicas` adds or removes replicas."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    # The served model's name: the `model_name` label of the target-replicas gauge.
    model_name: str = "iterserve"
    min_replicas: int = Field(1, ge=0, description="Lower bound on replicas.")
    max_replicas: int = Field(4, ge=1, description="Upper bound on replicas.")
    target_waiting_per_replica: float = Field(
        2.0, gt=0.0,
        description="Scale up while mean waiting requests per replica stays above this.",
    )
    kv_high_watermark: float = Field(
        0.85, gt=0.0, le=1.0,
        description="Scale up while mean KV usage stays above this.",
    )
    low_waiting_per_replica: float = Field(
        0.25, ge=0.0,
        description="Scale-down needs mean waiting per replica at or below this ...",
    )
    kv_low_watermark: float = Field(
        0.40, ge=0.0, le=1.0,
        description="... and mean KV usage, rescaled to one replica fewer, below this.",
    )
    low_running_per_replica: float = Field(
        7.0, ge=0.0,
        description="... and the running sequences over the fewer replicas at most this: "
        "scaling lands where each replica runs at most this many, spare concurrency for a "
        "burst that arrives faster than a replica starts (tournament, diurnal with a 3x "
        "spike in 10 s and 30 s start-ups, fixed replicas: running per replica rose 8-20x "
        "when arrivals tripled, since each step slows with the batch; ~9 before the spike "
        "absorbed it, ~11 barely, ~15 missed the SLO for 20 % of requests).",
    )
    high_running_per_replica: float = Field(
        10.0, gt=0.0,
        description="Scale up for headroom while the sustained running sequences per "
        "replica exceed this (to low_running_per_replica each): the load grew, slowly, "
        "past what the replicas absorb a burst on. (Sweep, diurnal 360 s and 600 s, loads "
        "0.4 and 0.8, seeds 0-2: low/high 7/10 met the SLO everywhere with the fewest "
        "GPU-hours; 6/8 kept too much at 0.8, 7/9 added a second step before the spike.)",
    )
    startup_s: float | None = Field(
        None, gt=0.0,
        description="The served model's measured start-up, scale decision to a new replica "
        "serving (loadtests/studies/replica_startup: a Serve start's stages but first_token). "
        "The headroom rule looks this far ahead: it projects the sustained load along its "
        "trend over headroom_window_s (least-squares slope of the 5 s means, growth only), "
        "so a slow-starting model adds replicas earlier. None: no look-ahead.",
    )
    headroom_window_s: float = Field(
        60.0, gt=0.0,
        description="The running-sequence history (5 s bucket means) the sustained load "
        "is taken from.",
    )
    headroom_quantile: float = Field(
        0.25, ge=0.0, le=0.5,
        description="The sustained load is this quantile of the history (and a scale-down "
        "lands on 1 minus it over downscale_delay_s): a burst shorter than (1 - quantile) "
        "x headroom_window_s (45 s) is absorbed, not scaled for.",
    )
    upscale_delay_s: float = Field(
        2.0, ge=0.0, description="Overload must last this long before scaling up.",
    )
    downscale_delay_s: float = Field(
        30.0, ge=0.0,
        description="A scale-down waits this long after the last change and lands on the "
        "need of the running sequences' upper quantile over it (the headroom bands keep a "
        "burst's room, so this delay only has to see past noise; 30 s vs 60 s: 3-8 % fewer "
        "GPU-hours, the same SLO, tournament diurnal).",
    )
    downscale_to_zero_delay_s: float | None = Field(
        None, ge=0.0,
        description="Serve's own AutoscalingConfig.downscale_to_zero_delay_s, passed through: "
        "with min_replicas 0, the last replica goes only after the policy has asked for 0 "
        "this long without a break (None: at once). Serve scales any other way down to 1 "
        "first, so the last replica always waits this delay.",
    )
    max_upscale_step: int = Field(
        16, ge=1,
        description="Most replicas added in one decision (the step is proportional to the "
        "pressure; 2 needed several 30 s start-ups to triple capacity).",
    )
    stats_stale_after_s: float = Field(
        10.0, gt=0.0,
        description="(Ray adapter) metrics older than this make the policy hold its target.",
    )
    look_back_period_s: float = Field(
        2.0, gt=0.0,
        description="AutoscalingConfig.look_back_period_s: window Serve aggregates over; "
        "record_autoscaling_stats runs every 0.2x this.",
    )
    metrics_push_interval_s: float = Field(
        0.5, gt=0.0,
        description="Value for RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S and "
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S (Serve default 10 s).",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be <= max_replicas "
                f"({self.max_replicas})"
            )
        if self.kv_low_watermark >= self.kv_high_watermark:
            raise ValueError("kv_low_watermark must be below kv_high_watermark")
        if self.low_waiting_per_replica >= self.target_waiting_per_replica:
            raise ValueError("low_waiting_per_replica must be below target_waiting_per_replica")
        if self.high_running_per_replica <= self.low_running_per_replica:
            raise ValueError("high_running_per_replica must exceed low_running_per_replica")
        if self.look_back_period_s <= self.metrics_push_interval_s:
            raise ValueError("look_back_period_s must exceed metrics_push_interval_s")
        return self
