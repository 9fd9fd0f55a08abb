"""A deployment's settings: what the user gave (`AppArgs`) and its one resolution (`AppSettings`).

    AppArgs      validated input, from any entry: `iterserve serve` flags, `serve run` key=value
                 args, a Serve YAML's `args:`, or a dict in Python
    resolve_app  -> AppSettings: the engine config resolved (every "auto" concrete, model name
                 from the model, replica devices from the cluster), the router and autoscaling
                 configs derived from it, built once and passed down as they are

Engine settings may be given flat (as `serve run` passes key=value strings) or under
`engine_kwargs`; flat keys that are not AppArgs fields are engine kwargs, with vLLM names or
TensorRT-LLM aliases (declared once, on EngineConfig's fields), coerced to the field types.
Unknown keys and bad values are a ValueError at resolution, before anything is deployed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from iterserve.autoscale.config import AutoscaleConfig, RouterConfig
from iterserve.dashboards.metrics import DEFAULT_PREFIX, MetricPrefix
from iterserve.deploy.engine_client import DEFAULT_HOLD_TIMEOUT_S
from iterserve.deploy.llm_replica import (
    drain_timeout_for,
    replica_actor_options,
    replica_engine_kwargs,
)
from iterserve.deploy.server import DEFAULT_MAX_BODY_BYTES
from iterserve.replica.config import KWARG_ALIASES, CacheConfig, EngineConfig, SchedulerConfig
from iterserve.replica.loader import read_model_config
from iterserve.replica.model_source import model_display_name, resolve_model_path
from iterserve.replica.resolve import resolve_engine_config

# Replica bounds are AutoscaleConfig's: one declaration, one rule.
_MIN_REPLICAS = AutoscaleConfig.model_fields["min_replicas"]
_MAX_REPLICAS = AutoscaleConfig.model_fields["max_replicas"]
_ZERO_DELAY = AutoscaleConfig.model_fields["downscale_to_zero_delay_s"]
_STARTUP = AutoscaleConfig.model_fields["startup_s"]


def _engine_field_types() -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        resolved = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in ("cache", "scheduler"):
                hints[f.name] = resolved[f.name]
    return hints


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """A `serve run key=value` string as the field's type (int, float, bool, optional)."""
    if not isinstance(value, str):
        return value
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) \
        else (hint,)
    if type(None) in options and value.strip().lower() in ("none", "null", ""):
        return None
    for option in options:
        if option is bool:
            lowered = value.strip().lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError(f"{name} must be true or false, got {value!r}")
        if option in (int, float):
            try:
                return option(value)
            except ValueError as error:
                raise ValueError(f"{name} must be {option.__name__}, got {value!r}") from error
    return value


def coerce_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine kwargs with string values parsed to the EngineConfig field types."""
    types_of = _engine_field_types()
    out = {}
    for key, value in kwargs.items():
        name = KWARG_ALIASES.get(key, key)
        if name not in types_of:
            raise ValueError(f"unknown engine argument {key!r}")
        out[key] = _coerce(key, value, types_of[name])
    return out


class AppArgs(BaseModel):
    """Arguments of the iterserve Serve application (CLI, `serve run`, YAML `args:`)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(
        None, description="an HF checkpoint folder, a .gguf file, or iterserve-tiny (the tiny "
        "random-weight test model); default: the built-in SmolLM2-135M-Instruct")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int | str = Field(
        1, description="LLMReplica count (one per GPU), or 'auto' (the KV autoscaler)")
    autoscaling_config: dict[str, Any] | None = None
    request_router_config: dict[str, Any] | None = None  # wins over `router`
    router: Literal["kv-prefix", "kv", "pow2"] = Field(
        "kv-prefix", description="KV-aware router with or without prefix affinity, or Ray's "
        "default power-of-two")
    min_replicas: int = _MIN_REPLICAS  # with num_replicas="auto"
    max_replicas: int = _MAX_REPLICAS
    downscale_to_zero_delay_s: float | None = _ZERO_DELAY
    startup_s: float | None = _STARTUP
    max_ongoing_requests: int = Field(256, ge=1, description="Serve's per-replica in-flight "
                                      "bound")
    max_queued_requests: int | None = Field(
        None, ge=1, description="requests Serve holds at each ingress for LLMReplica while "
        "no replica can take them (none yet, or all at max_ongoing_requests); beyond it: 429 "
        "with Retry-After (Serve's max_queued_requests; default: no bound)")
    hold_timeout_s: float = Field(
        DEFAULT_HOLD_TIMEOUT_S, gt=0, description="how long a request may wait for a "
        "replica to take it (scaling from zero, or every replica busy); past it: 503 with "
        "Retry-After")
    num_gpus_per_replica: float | None = Field(
        None, description="GPUs per LLMReplica (default: 1 when the cluster has GPUs, else 0)")
    num_cpus_per_replica: float | None = Field(
        None, description="CPUs per LLMReplica (default: 1 with a GPU, else 0.5)")
    num_ingress_replicas: int = Field(1, ge=1, description="OpenAIIngress replicas")
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_key_file: str | None = Field(
        None, description="a keys file: one API key per line, optionally followed by its "
        "tenant, and `tenant NAME key=value ...` lines (weight, priority, tokens_per_minute, "
        "requests_per_minute, max_concurrent_requests, ttft_slo_ms, cache_share, "
        "sub_tenant_from, sub_tenants, unknown_sub_tenant; README: Tenants)")
    tenant_cache_isolation: bool = Field(
        True, description="salt each tenant's prefix-cache blocks with its name (or its "
        "cache_share group), so no tenant hits, or can time, another's cached prompt; off: "
        "every tenant shares one cache (a request's cache_salt still applies)")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024,
                                description="request body limit (413 beyond it)")
    model_aliases: list[str] = Field(default_factory=list)
    drain_timeout_s: float | None = Field(
        None, ge=0, description="how long a replica being removed waits for its streams "
        "(default: long enough for the longest allowed generation, from max_model_len)")
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="at most this many LLMReplicas per node (1: a lost node takes "
        "one replica with it)")
    metrics_prefix: MetricPrefix = Field(
        DEFAULT_PREFIX, description="metric names: iterserve's, vLLM's exact names (vllm:), "
        "or promtool-clean (iterserve_)")
    kv_pull: Literal["off", "on", "always"] = Field(
        "off", description="on: a replica that misses a prompt's prefix pulls it from the "
        "replica whose report holds it, through Ray's object store, when the cost rule says "
        "that beats computing it; always: whenever a peer holds more (to measure the pull "
        "itself); needs kv_offloading_size (the blocks land in the host KV tier) and a kv router")
    kv_pull_max_bytes: int = Field(
        64 * 2**20, ge=1, description="the most KV bytes one pull moves (a longer prefix: "
        "its leading part is pulled, the rest computed); keep it under half the object store")
    kv_pull_timeout_s: float = Field(
        2.0, gt=0, description="the most a pull may add to a request's time to first token; "
        "past it the request computes its prefix")
    chat_template: str | None = Field(None, description="chat template replacing the "
                                      "model's: tool_chatml, tool_llama3_json or a .jinja file")
    tool_call_parser: str | None = Field(None, description="how tool calls are read from "
                                         "the output: hermes (default) or llama3_json")

    @model_validator(mode="before")
    @classmethod
    def _lift_engine_kwargs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        own = set(cls.model_fields)
        data = dict(data)
        engine = dict(data.pop("engine_kwargs", None) or {})
        for key in [k for k in data if k not in own]:
            engine[key] = data.pop(key)
        _lift_model(data, engine)
        data["engine_kwargs"] = coerce_engine_kwargs(engine)
        if isinstance(data.get("api_keys"), str):
            data["api_keys"] = [k for k in data["api_keys"].split(",") if k.strip()]
        return data

    @field_validator("num_replicas")
    @classmethod
    def _replicas(cls, value: int | str) -> int | str:
        if isinstance(value, str):
            if value == "auto":
                return value
            if not value.isdigit():
                raise ValueError(f"num_replicas must be an int or 'auto', got {value!r}")
            value = int(value)
        if value < 1:
            raise ValueError(f"num_replicas must be >= 1, got {value}")
        return value

    def engine_config(self) -> EngineConfig:
        """Validates the engine settings now (raises ValueError), without loading a model."""
        kwargs = replica_engine_kwargs(self.engine_kwargs)
        kwargs.setdefault("cpu_replicas_per_node", self.replicas_per_node())
        return EngineConfig.from_kwargs(model=self.model, **kwargs)

    def replicas_per_node(self) -> int:
        """The most LLMReplicas that may share one node: on CPU they divide its free memory
        for their KV caches (replica/cpu_memory.py). Without max_replicas_per_node any may
        land together (one node, embedded Ray), so every replica counts."""
        most = self.num_replicas if isinstance(self.num_replicas, int) else self.max_replicas
        return min(most, self.max_replicas_per_node or most)


def _lift_model(data: dict[str, Any], engine: dict[str, Any]) -> None:
    """engine_kwargs may name the model too (one dict for LLM() and the app); it moves up."""
    if "model" not in engine:
        return
    model = engine.pop("model")
    if data.get("model") not in (None, model):
        raise ValueError(f"model is given twice: {data['model']!r} and {model!r} in engine_kwargs")
    data["model"] = model




@dataclass(frozen=True)
class AppSettings:
    """Everything a deployment needs, resolved once and passed down as is.

    engine: the EngineConfig every replica runs (resolved for the replicas' device).
    router: the KV-aware router's config (None: Ray's power-of-two, or the user's own
    `request_router_config`). autoscale: the autoscaling policy's config (None: a fixed
    `num_replicas`). replica_actor_options: Ray resources of one replica. drain_timeout_s:
    the drain of a stopping replica (`drain_timeout_for(max_model_len)` unless given).
    """

    args: AppArgs
    engine: EngineConfig
    router: RouterConfig | None
    autoscale: AutoscaleConfig | None
    replica_actor_options: dict[str, float]
    drain_timeout_s: float


def resolve_app(args: dict[str, Any] | AppArgs | AppSettings | None = None) -> AppSettings:
    """The one resolution point of a deployment's settings (raises ValueError)."""
    if isinstance(args, AppSettings):
        return args
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    actor_options = replica_actor_options(app_args.num_gpus_per_replica,
                                          app_args.num_cpus_per_replica)
    engine = resolve_engine_config(app_args.engine_config(),
                                   cuda_available=actor_options["num_gpus"] > 0,
                                   model_files_here=False)
    model_name = engine.served_model_name or model_name_of(engine.model)
    router = None
    if app_args.request_router_config is None and app_args.router != "pow2":
        router = RouterConfig(model_name=model_name,
                              prefix_affinity=app_args.router == "kv-prefix",
                              prefix_block_size=engine.cache.block_size,
                              kv_pull_hints=app_args.kv_pull != "off")
    if app_args.kv_pull != "off":
        _check_kv_pull(engine, router)
    autoscale = None
    if app_args.autoscaling_config is None and app_args.num_replicas == "auto":
        autoscale = AutoscaleConfig(model_name=model_name, min_replicas=app_args.min_replicas,
                                    max_replicas=app_args.max_replicas,
                                    downscale_to_zero_delay_s=app_args.downscale_to_zero_delay_s,
                                    startup_s=app_args.startup_s)
    return AppSettings(app_args, engine, router, autoscale, actor_options,
                       _drain_timeout_s(app_args, engine))


def _check_kv_pull(engine: EngineConfig, router: RouterConfig | None) -> None:
    """Prefix pulls need somewhere to land and someone to say where the prefix is."""
    if engine.cache.kv_offloading_size is None:
        raise ValueError("kv_pull needs kv_offloading_size: pulled blocks land in the host KV "
                         "tier, from where the engine copies them to the device")
    if router is None or not router.use_replica_cache_reports:
        raise ValueError("kv_pull needs the kv or kv-prefix router with replica cache reports: "
                         "it says which replica holds a prompt's prefix")


def _drain_timeout_s(app_args: AppArgs, engine: EngineConfig) -> float:
    if app_args.drain_timeout_s is not None:
        return app_args.drain_timeout_s
    max_model_len = engine.scheduler.max_model_len
    if max_model_len is None:  # the model's own context length
        max_model_len = read_model_config(resolve_model_path(engine.model)).max_position_embeddings
    return drain_timeout_for(max_model_len)


def model_name_of(model: str | None) -> str:
    """The served name of a model the driver cannot read (its files live on the GPU nodes)."""
    return model_display_name(Path(model)) if model else "iterserve"
