"""OpenAIIngress: the Serve ingress deployment in front of the LLMReplica deployment.

The FastAPI app is built per replica at init time (`@serve.ingress()` with
`__serve_build_asgi_app__`, Ray Serve 2.60), so API keys and the body limit are constructor
arguments rather than module globals. The ingress tokenizes, applies the chat template and
checks the prompt length; the replicas only ever see token ids and SamplingParams. It gets
the replicas' engine config and resolves it here, where it loads the tokenizer (started at
init), so it answers the model card, /tokenize and /detokenize itself: at zero replicas
those never start one.
`begin_drain` and `in_flight` are how `iterserve serve` drains it on SIGTERM
(deploy/shutdown.py): the handle calls them on every ingress replica.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from iterserve.dashboards.metrics import DEFAULT_PREFIX
from iterserve.dashboards.tenant_metrics import TenantMetrics
from iterserve.deploy.auth import load_api_keys
from iterserve.deploy.engine_client import DEFAULT_HOLD_TIMEOUT_S, HandleEngineClient
from iterserve.deploy.lifecycle import ServingState
from iterserve.deploy.lora_registry import RayAdapterRegistry, registry_actor_name
from iterserve.deploy.quotas import RayQuotas, quota_actor_name
from iterserve.deploy.server import DEFAULT_MAX_BODY_BYTES, IngressSettings, create_app
from iterserve.deploy.tenant_requests import Tenancy
from iterserve.deploy.tool_calls import ToolSettings
from iterserve.replica.config import EngineConfig
from iterserve.replica.resolve import resolve_engine_config

logger = logging.getLogger(__name__)


def tenancy_for(settings: IngressSettings, model_name: str, metrics_prefix: str) -> Tenancy:
    """The tenants' services of this ingress replica: per-tenant metrics, and, where some
    tenant has a quota, the application's one ledger (a named Ray actor: every ingress
    replica counts against the same quota)."""
    metrics = TenantMetrics(model_name, prefix=metrics_prefix)
    if not any(t.quota.limited for t in settings.tenants):
        return Tenancy(metrics=metrics)
    app_name = serve.get_replica_context().app_name
    return Tenancy(quotas=RayQuotas(quota_actor_name(app_name)), metrics=metrics)


@serve.deployment(
    name="OpenAIIngress",
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=10,
)
@serve.ingress()
class OpenAIIngress:
    """HTTP edge: auth, validation, tokenization; streams from LLMReplica over a handle."""

    async def __init__(
        self,
        engine: DeploymentHandle,
        engine_config: EngineConfig,
        scales_to_zero: bool = False,
        hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
        api_keys: tuple[Any, ...] = (),
        api_key_file: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        model_aliases: tuple[str, ...] = (),
        tools: ToolSettings | None = None,
        tenant_cache_isolation: bool = True,
        metrics_prefix: str = DEFAULT_PREFIX,
    ) -> None:
        """engine_config: the replicas' (deploy/settings.py), resolved once more here, where
        the model's files are read (a cluster's driver may not have them)."""
        keys = load_api_keys(api_keys, api_key_file)  # a malformed keys file stops start-up
        self._settings = IngressSettings(api_keys=keys.keys, tenants=keys.tenants,
                                         tenant_cache_isolation=tenant_cache_isolation,
                                         max_body_bytes=max_body_bytes,
                                         model_aliases=tuple(model_aliases),
                                         tools=tools or ToolSettings())
        resolved = resolve_engine_config(
            engine_config, cuda_available=engine_config.device.startswith("cuda"))
        app_name = serve.get_replica_context().app_name
        self._client = HandleEngineClient(
            engine, resolved, scales_to_zero, hold_timeout_s,
            adapters=RayAdapterRegistry(registry_actor_name(app_name)))
        self._client.warm_up()  # the tokenizer loads while Serve starts the rest
        self._state = ServingState()
        self._tenancy = tenancy_for(self._settings, str(resolved.served_model_name),
                                    metrics_prefix)
        logger.info("OpenAIIngress ready: %r", self._settings)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self._client, self._settings, self._state, self._tenancy)

    def begin_drain(self) -> int:
        """Stop admitting (/health and every API route answer 503); the requests in flight."""
        return self._state.begin_drain()

    def in_flight(self) -> int:
        return self._state.in_flight
