"""The Serve application builder: `build_app(args) -> Application`.

Usable three ways, all resolved by the same function (`deploy/settings.py: resolve_app`):

    serve run iterserve.deploy.app:build_app model=/models/x max_num_seqs=32 num_replicas=2
    serve run deploy/configs/local-cpu.yaml            # import_path + args in YAML
    iterserve serve --model /models/x --max-num-seqs 32   # the CLI calls build_app
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from iterserve.autoscale.autoscaling_policy import serve_autoscaling_config
from iterserve.autoscale.router import request_router_config_dict
from iterserve.deploy.ingress import OpenAIIngress
from iterserve.deploy.kv_pull import KVPullConfig
from iterserve.deploy.llm_replica import SHUTDOWN_SLACK_S, LLMReplica
from iterserve.deploy.settings import AppArgs, AppSettings, coerce_engine_kwargs, resolve_app
from iterserve.deploy.tool_calls import ToolSettings

__all__ = ["APP_NAME", "AppArgs", "AppSettings", "build_app", "coerce_engine_kwargs",
           "resolve_app"]

APP_NAME = "iterserve"


def routing_and_scaling_options(settings: AppSettings) -> dict[str, Any]:
    """LLMReplica's request router and, with num_replicas="auto", its autoscaling policy."""
    args = settings.args
    options: dict[str, Any] = {}
    if args.request_router_config is not None:
        options["request_router_config"] = args.request_router_config
    elif settings.router is not None:
        options["request_router_config"] = request_router_config_dict(settings.router)
    if args.autoscaling_config is not None:
        options["autoscaling_config"] = args.autoscaling_config
    elif settings.autoscale is not None:
        options["autoscaling_config"] = serve_autoscaling_config(settings.autoscale)
    return options


def scales_to_zero(settings: AppSettings) -> bool:
    """Whether LLMReplica may have no replica: autoscaled with min_replicas 0."""
    if settings.args.autoscaling_config is not None:
        return int(settings.args.autoscaling_config.get("min_replicas", 1)) == 0
    return settings.autoscale is not None and settings.autoscale.min_replicas == 0


def build_app(args: dict[str, Any] | AppArgs | AppSettings | None = None) -> Application:
    """The iterserve application: OpenAIIngress -> LLMReplica x num_replicas."""
    settings = resolve_app(args)
    app_args = settings.args
    # Both deployments drain for the longest allowed generation: a redeploy that changes the
    # args replaces the ingress too, and an ingress stopped with Serve's default 20 s cut a
    # stream it was relaying (RELIABILITY.md section 8).
    graceful_shutdown_s = settings.drain_timeout_s + SHUTDOWN_SLACK_S
    replica_options: dict[str, Any] = {
        "num_replicas": app_args.num_replicas,
        "max_ongoing_requests": app_args.max_ongoing_requests,
        "ray_actor_options": settings.replica_actor_options,
        "graceful_shutdown_timeout_s": graceful_shutdown_s,
    }
    if app_args.max_replicas_per_node is not None:
        replica_options["max_replicas_per_node"] = app_args.max_replicas_per_node
    if app_args.max_queued_requests is not None:
        replica_options["max_queued_requests"] = app_args.max_queued_requests
    replica_options.update(routing_and_scaling_options(settings))
    kv_pull = KVPullConfig(app_args.kv_pull, app_args.kv_pull_max_bytes,
                           app_args.kv_pull_timeout_s)
    replica = LLMReplica.options(**replica_options).bind(
        settings.engine, settings.drain_timeout_s, app_args.metrics_prefix, kv_pull)
    return OpenAIIngress.options(num_replicas=app_args.num_ingress_replicas,
                                 graceful_shutdown_timeout_s=graceful_shutdown_s).bind(
        replica,
        settings.engine,
        scales_to_zero=scales_to_zero(settings),
        hold_timeout_s=app_args.hold_timeout_s,
        api_keys=tuple(app_args.api_keys),
        api_key_file=app_args.api_key_file,
        tenant_cache_isolation=app_args.tenant_cache_isolation,
        metrics_prefix=app_args.metrics_prefix,
        max_body_bytes=app_args.max_body_bytes,
        model_aliases=tuple(app_args.model_aliases),
        tools=ToolSettings.from_flags(app_args.chat_template, app_args.tool_call_parser,
                                      builtin_model=app_args.model is None),
    )
