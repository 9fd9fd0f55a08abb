"""`KVAwareRouter`: the thin Ray Serve 2.60 adapter around `KVRouterCore` (router_state.py).

Attach it to the replica deployment (not to an HTTP ingress, whose router sees ASGI plumbing):

    from iterserve.autoscale.router import request_router_config
    @serve.deployment(request_router_config=request_router_config(RouterConfig()))
    class LLMReplica:
        async def record_routing_stats(self) -> dict:
            return ReplicaLoad.from_engine_stats(...).with_cached_blocks(hashes, 16).to_dict()
        async def generate(self, prompt_token_ids: list[int], ...): ...

What the router reads from a request (PendingRequest.args / kwargs of the handle call):
the prompt's token ids, for prefix affinity and the replicas' cache reports, from (first match wins)
  1. kwargs["prompt_token_ids"]   (a list/tuple of ints)
  2. args[0] if it is a list/tuple of ints
  3. args[0]["prompt_token_ids"] or args[0].prompt_token_ids if args[0] is a dict / object
Anything else: no affinity, load-only ranking. And the request's output budget, to size its
KV footprint (prompt + max_tokens) for the watermark check, from (first match wins)
  1. kwargs["params"] / kwargs["sampling_params"] with a `max_tokens` attribute or key
  2. args[1] with a `max_tokens` attribute or key (deploy's generate(ids, params, rid))
  3. args[0]["max_tokens"] / args[0].max_tokens
Missing: only the prompt counts. And `route_to_replica` (ROUTE_TO_KWARG): a replica id that
the call must reach, alone (a prefix pull, deploy/kv_pull.py). And the request's prefix-cache
namespace (its tenant's salt,
replica/block_keys.py) from kwargs["cache_namespace"] (bytes; missing: the shared b""), so
its prompt is looked up in the replicas' reports, and its affinity keyed, in that namespace
only. And its LoRA adapter (kwargs["lora_request"] or args[4], an object with a
`name`): the namespace narrows to the adapter's, and a replica holding the adapter is
preferred under a load guard (autoscale/lora_affinity.py). Nothing else is read.

Which replica holds the prompt's prefix: the replicas' routing stats carry the stable hashes
of the blocks their prefix caches can hit (deploy/llm_replica.py, replica/block_hashes.py); the
router hashes the prompt's blocks the same way and passes each reporting replica's cached
prefix as `cached_tokens` (autoscale/replica_cache_reports.py), as the simulator's
`IterserveRouter` does. Without reports (RouterConfig.use_replica_cache_reports off, or
replicas that send none) the affinity table of recent routes stands in.

Each process that holds a handle (every ingress replica) has its own router instance; the
routers share nothing but the replicas' routing_stats, which Serve polls every
request_routing_stats_period_s. Between polls each router corrects the stale stats with
its own in-flight count (`InFlightTracker`). With RouterConfig.router_sync_period_s set they
also exchange their sends and completions through a named Ray actor (`router_sync`), and
each counts the others' in flight as its own.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from iterserve.autoscale.config import RouterConfig
from iterserve.autoscale.lora_affinity import (
    prefer_adapter_holders,
    request_adapter,
    waiting_counts,
)
from iterserve.autoscale.lora_in_flight import AdaptersInFlight, with_adapters_in_flight
from iterserve.autoscale.lora_traffic import AdapterTraffic
from iterserve.autoscale.pull_pricing import pullable_tokens, with_pull_credit
from iterserve.autoscale.replica_cache_reports import (
    ParsedLoads,
    cached_prefix_tiers,
    cached_prefix_tokens,
    charge_tiers,
)
from iterserve.autoscale.route_target_gone import RouteTargetGone
from iterserve.autoscale.router_policy import to_rank_groups
from iterserve.autoscale.router_state import KVRouterCore
from iterserve.autoscale.router_sync import RayHub, RouterSync, hub_name
from iterserve.autoscale.shuffle import shuffle
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.dashboards.metrics import RouterMetrics
from iterserve.replica.block_keys import CacheNamespace, with_adapter

ROUTER_CLASS_PATH = "iterserve.autoscale.router:KVAwareRouter"
# A call naming a replica's unique id in this kwarg reaches that replica alone, or fails at
# once with RouteTargetGone while it is not among the live replicas: a replica pulling a
# prefix from a peer (deploy/kv_pull.py), a study placing a request where it wants it.
ROUTE_TO_KWARG = "route_to_replica"
# With RouterConfig.kv_pull_hints, a generate call gets this kwarg: (the unique id of the
# replica whose report holds the longest prefix of the prompt, its cached tokens).
PULL_HINT_KWARG = "kv_pull_hint"
# Requests chosen for but not yet routed whose cache answers are kept (Serve routes a
# request soon after choosing; more than this pending at once are charged their whole prompt).
MAX_REMEMBERED_HITS = 4096


def extract_prompt_token_ids(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids from a handle call's args, or None (see module docstring)."""
    candidate: Any = kwargs.get("prompt_token_ids")
    if candidate is None and args:
        first = args[0]
        if isinstance(first, (list, tuple)):
            candidate = first
        elif isinstance(first, dict):
            candidate = first.get("prompt_token_ids")
        else:
            candidate = getattr(first, "prompt_token_ids", None)
    if not isinstance(candidate, (list, tuple)) or not candidate:
        return None
    if not isinstance(candidate[0], int):
        return None
    return list(candidate)


def extract_cache_namespace(kwargs: dict[str, Any]) -> CacheNamespace:
    """The request's prefix-cache namespace (see module docstring); b"" when none."""
    namespace = kwargs.get("cache_namespace")
    return namespace if isinstance(namespace, bytes) else b""


def request_namespace(pending_request: PendingRequest | None) -> CacheNamespace:
    """The namespace the request's blocks live in on the replicas: its tenant's, narrowed to
    its LoRA adapter's (as the engine narrows it: block_keys.with_adapter)."""
    if pending_request is None:
        return b""
    return with_adapter(extract_cache_namespace(pending_request.kwargs),
                        request_adapter(pending_request.args, pending_request.kwargs))


def _max_tokens_of(obj: Any) -> int | None:  # noqa: ANN401
    value = obj.get("max_tokens") if isinstance(obj, dict) else getattr(obj, "max_tokens", None)
    return value if isinstance(value, int) and value >= 0 else None


def extract_max_tokens(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The request's max_tokens (see module docstring), or 0 when not found."""
    candidates = [kwargs.get("params"), kwargs.get("sampling_params")]
    if len(args) > 1:
        candidates.append(args[1])
    if args and not isinstance(args[0], (list, tuple)):
        candidates.append(args[0])
    for candidate in candidates:
        if candidate is not None:
            value = _max_tokens_of(candidate)
            if value is not None:
                return value
    return 0


class KVAwareRouter(FIFOMixin, RequestRouter):
    """Ranks replicas by KV watermark, waiting queue and KV usage, and by which of them
    caches the prompt's prefix (their own reports; else optional prefix affinity).

    Serve builds it (do not override __init__) and calls `initialize_state(**kwargs)` with
    `RequestRouterConfig.request_router_kwargs`, i.e. `RouterConfig(...).model_dump()`.

    FIFOMixin hands a chosen replica to the oldest pending request, as Ray's default router
    does. Without it, Ray 2.60's exact-match hand-off could leave one of two requests that
    were pending at once unrouted for good (a hang seen with a two-prompt completion).
    """

    def initialize_state(self, **kwargs: Any) -> None:  # noqa: ANN401
        self.config = RouterConfig(**kwargs)
        self._core: KVRouterCore[ReplicaID] = KVRouterCore(self.config)
        self._rng = random.Random()
        self._metrics = RouterMetrics(self.config.model_name)
        self._parsed = ParsedLoads()
        # choose_replicas' cache answers by internal request id, until on_request_routed
        # charges the chosen replica only the prompt tokens it does not cache (bounded:
        # a request Serve never routes must not stay here forever).
        self._hits: dict[str, dict[ReplicaID, int]] = {}
        self._replica_ids: dict[str, ReplicaID] = {}  # unique id -> id, for peers' events
        # The adapters of this router's requests in flight per replica: held and running
        # there before the replica's stats can say so (lora_in_flight.py).
        self._adapters_in_flight: AdaptersInFlight[ReplicaID] = AdaptersInFlight()
        # Each adapter's share of the requests routed lately: when it needs another holder
        # (lora_traffic.py).
        self._adapter_traffic = AdapterTraffic(self.config.lora_traffic_half_life_s)
        self._sync: RouterSync | None = None
        if self.config.router_sync_period_s is not None:
            deployment = self._deployment_id
            self._sync = RouterSync(
                self._core, lambda: RayHub(hub_name(deployment.app_name, deployment.name)),
                self.config.router_sync_period_s,
                on_exchange=self._metrics.record_sync_exchange)

    def _ensure_state(self) -> None:
        # Serve calls initialize_state(**request_router_kwargs) right after construction;
        # a router built by hand (tests) may not have.
        if not hasattr(self, "config"):
            self.initialize_state()

    def _loads(self, replicas: Sequence[RunningReplica]) -> list[ReplicaLoad | None]:
        return [self._parsed.load(r.replica_id, r.routing_stats) for r in replicas]

    def _prompt(self, pending_request: PendingRequest | None
                ) -> tuple[list[int] | None, int | None, int]:
        """(the prompt's token ids, prefix-affinity key, KV footprint: prompt + max_tokens);
        (None, None, 0) when the request carries no token ids. The affinity key is the
        prompt's in its cache namespace: another namespace's equal prompt is another key."""
        if pending_request is None:
            return None, None, 0
        token_ids = extract_prompt_token_ids(pending_request.args, pending_request.kwargs)
        if token_ids is None:
            return None, None, 0
        max_tokens = extract_max_tokens(pending_request.args, pending_request.kwargs)
        key, footprint = self._core.request_key(
            token_ids, max_tokens, request_namespace(pending_request))
        return token_ids, key, footprint

    def _cached_tokens(self, token_ids: list[int] | None, replica_ids: Sequence[ReplicaID],
                       loads: Sequence[ReplicaLoad | None], namespace: CacheNamespace
                       ) -> tuple[dict[ReplicaID, int] | None, dict[ReplicaID, int] | None]:
        """(each replica's cache answer in prefill tokens saved, the tokens each could send
        a puller); with kv_pull_hints each answer is credited what a pull from the best
        other holder would save (pull_pricing.py), else the second is None."""
        if token_ids is None or not self.config.use_replica_cache_reports:
            return None, None
        tier_costs = self.config if self.config.score_kv_tiers else None
        if not self.config.kv_pull_hints:
            return cached_prefix_tokens(token_ids, replica_ids, loads, namespace,
                                        tier_costs=tier_costs), None
        tiers = cached_prefix_tiers(token_ids, replica_ids, loads, namespace)
        if tiers is None:
            return None, None
        load_of = dict(zip(replica_ids, loads, strict=True))
        charged = (charge_tiers(tiers, load_of, tier_costs) if tier_costs is not None else
                   cached_prefix_tokens(token_ids, replica_ids, loads, namespace) or {})
        return (with_pull_credit(charged, tiers, replica_ids, load_of, self.config),
                pullable_tokens(tiers))

    def _remember_hits(self, request_id: str, hits: dict[ReplicaID, int]) -> None:
        self._hits.pop(request_id, None)  # re-inserted last: the newest
        self._hits[request_id] = hits
        if len(self._hits) > MAX_REMEMBERED_HITS:
            del self._hits[next(iter(self._hits))]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._ensure_state()
        if self._sync is not None:
            self._sync.ensure_running(self._replica_ids.get)
        if not candidate_replicas:
            return []
        # Shuffle first: ties keep candidate order, and independent routers should not all
        # break ties towards the same replica.
        shuffled = list(candidate_replicas)
        shuffle(self._rng, shuffled)
        by_id = {r.replica_id: r for r in shuffled}
        loads = self._loads(shuffled)
        token_ids, key, num_tokens = self._prompt(pending_request)
        adapter = (request_adapter(pending_request.args, pending_request.kwargs)
                   if pending_request is not None else None)
        replica_ids = [r.replica_id for r in shuffled]
        cached, pullable = self._cached_tokens(token_ids, replica_ids, loads,
                                               request_namespace(pending_request))
        ranked = self._core.rank(replica_ids, loads, key, num_tokens, time.time(),
                                 prompt_tokens=len(token_ids or ()), cached_tokens=cached)
        if adapter is not None:
            now = time.time()
            waiting = waiting_counts(replica_ids, loads, [self._core.in_flight.correction(
                rid, load) for rid, load in zip(replica_ids, loads, strict=True)], now,
                self.config)
            held = {rid: with_adapters_in_flight(load, self._adapters_in_flight.adapters(rid))
                    for rid, load in zip(replica_ids, loads, strict=True)}
            ranked = prefer_adapter_holders(ranked, held, waiting, adapter,
                                            self.config.lora_affinity_slack,
                                            self._adapter_traffic.share(adapter, now,
                                                                        len(replica_ids)))
        if pending_request is not None and cached is not None:
            self._remember_hits(pending_request.metadata.internal_request_id, cached)
            if pullable is not None:
                self._hint_holder(pending_request, pullable)
        if pending_request is not None:
            # We return every replica, so if all ranks fail Serve must back off before
            # asking again; without this flag it retries in a hot loop (2.60 behaviour).
            pending_request.routing_context.should_backoff = True
            target = pending_request.kwargs.get(ROUTE_TO_KWARG)
            if isinstance(target, str):
                named = [[by_id[rid]] for rid in replica_ids if rid.unique_id == target]
                return named or self._fail_gone_target(pending_request, target, shuffled)
        return [[by_id[rid] for rid in group] for group in to_rank_groups(ranked)]

    def _fail_gone_target(self, pending_request: PendingRequest, target: str,
                          candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Fail a call whose named replica is not running, now: Serve would otherwise retry
        it with backoff until its caller gives up (a pull from a dead holder waited out the
        whole --kv-pull-timeout-s). The error reaches the caller through the request's
        future, which Serve's routing awaits; the candidates returned make Serve's routing
        loop see that future done and stop (it checks before it picks one), and the index
        entry is dropped as Serve drops a cancelled request's."""
        if not pending_request.future.done():
            pending_request.future.set_exception(RouteTargetGone(target))
        self._remove_pending_request_from_indices(pending_request)
        return [list(candidates)]

    @staticmethod
    def _hint_holder(pending_request: PendingRequest, pullable: dict[ReplicaID, int]) -> None:
        """Tell a generate call which replica holds the longest prefix of its prompt (in
        its device and host tiers, the tokens it can send): wherever Serve sends it, that
        replica may pull the prefix from there instead of computing it (route here, pull
        from there; the ranking already credited that pull)."""
        if pending_request.metadata.call_method != "generate" or not pullable:
            return
        holder, tokens = max(pullable.items(), key=lambda item: item[1])
        if tokens > 0:
            pending_request.kwargs[PULL_HINT_KWARG] = (holder.unique_id, tokens)

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: ReplicaResult,
    ) -> None:
        self._ensure_state()
        token_ids, key, num_tokens = self._prompt(pending_request)
        request_id = pending_request.metadata.internal_request_id
        hit = self._hits.pop(request_id, {}).get(replica_id, 0)
        now, prefill = time.time(), max(0, len(token_ids or ()) - hit)
        self._core.routed(request_id, replica_id, now, key, num_tokens, prefill_tokens=prefill)
        adapter = request_adapter(pending_request.args, pending_request.kwargs)
        self._adapters_in_flight.routed(request_id, replica_id, adapter)
        self._adapter_traffic.record(adapter, now)
        if self._sync is not None:
            self._sync.sent(request_id, replica_id.unique_id, now, num_tokens, prefill)
        self._metrics.record_decision(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ensure_state()
        self._core.completed(internal_request_id)
        self._adapters_in_flight.completed(internal_request_id)
        if self._sync is not None:
            self._sync.completed(internal_request_id, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._ensure_state()
        self._core.keep_only(r.replica_id for r in replicas)
        self._parsed.keep_only(r.replica_id for r in replicas)
        self._adapters_in_flight.keep_only(r.replica_id for r in replicas)
        self._replica_ids = {r.replica_id.unique_id: r.replica_id for r in replicas}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self._core.replica_died(replica_id)
        self._parsed.forget(replica_id)


def request_router_config(config: RouterConfig | None = None) -> RequestRouterConfig:
    """The `request_router_config=` for the replica deployment."""
    config = config or RouterConfig()
    return RequestRouterConfig(
        request_router_class=ROUTER_CLASS_PATH,
        request_router_kwargs=config.model_dump(),
        request_routing_stats_period_s=config.routing_stats_period_s,
        request_routing_stats_timeout_s=config.routing_stats_timeout_s,
    )


def request_router_config_dict(config: RouterConfig | None = None) -> dict[str, Any]:
    """The same as plain JSON: for `AppArgs.request_router_config`, YAML and Serve configs."""
    config = config or RouterConfig()
    return {
        "request_router_class": ROUTER_CLASS_PATH,
        "request_router_kwargs": config.model_dump(),
        "request_routing_stats_period_s": config.routing_stats_period_s,
        "request_routing_stats_timeout_s": config.routing_stats_timeout_s,
    }
