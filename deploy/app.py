"""The Serve application builder: `build_app(args) -> Application`.

Usable three ways, all validated by the same pydantic model (`AppArgs`):

    serve run iterserve.deploy.app:build_app model=/models/x max_num_seqs=32 num_replicas=2
    serve run deploy/configs/local-cpu.yaml            # import_path + args in YAML
    iterserve serve --model /models/x --max-num-seqs 32   # the CLI calls build_app

Engine settings may be given flat (as `serve run` passes key=value strings) or under
`engine_kwargs`; flat keys that are not AppArgs fields are engine kwargs, with vLLM names or
TensorRT-LLM aliases, coerced to the EngineConfig field types. Unknown keys are a ValueError
at build time, before anything is deployed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from ray.serve import Application

from iterserve.deploy.engine_info import resolve_model_path
from iterserve.deploy.ingress import OpenAIIngress
from iterserve.deploy.replica import DEFAULT_DRAIN_TIMEOUT_S, LLMReplica, replica_actor_options
from iterserve.deploy.server import DEFAULT_MAX_BODY_BYTES
from iterserve.replica.config import KWARG_ALIASES, CacheConfig, EngineConfig, SchedulerConfig
from iterserve.replica.model_source import model_display_name

APP_NAME = "iterserve"


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

    # An HF checkpoint folder, a .gguf file or "iterserve-tiny"; None = built-in SmolLM2.
    model: str | None = None
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int | str = 1  # an int, or "auto" with autoscaling_config
    autoscaling_config: dict[str, Any] | None = None
    request_router_config: dict[str, Any] | None = None  # wins over `router`
    # kv-prefix: KVAwareRouter with prefix affinity; kv: without; pow2: Ray's default router.
    router: Literal["kv-prefix", "kv", "pow2"] = "kv-prefix"
    min_replicas: int = Field(1, ge=1)  # with num_replicas="auto"
    max_replicas: int = Field(4, ge=1)
    max_ongoing_requests: int = Field(256, ge=1)  # per LLMReplica
    num_gpus_per_replica: float | None = None  # None: 1 if the cluster has GPUs, else 0
    num_cpus_per_replica: float | None = None
    num_ingress_replicas: int = Field(1, ge=1)
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_key_file: str | None = None
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    model_aliases: list[str] = Field(default_factory=list)
    drain_timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, ge=0)

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
        return EngineConfig.from_kwargs(model=self.model, **self.engine_kwargs)


def _lift_model(data: dict[str, Any], engine: dict[str, Any]) -> None:
    """engine_kwargs may name the model too (one dict for LLM() and the app); it moves up."""
    if "model" not in engine:
        return
    model = engine.pop("model")
    if data.get("model") not in (None, model):
        raise ValueError(f"model is given twice: {data['model']!r} and {model!r} in engine_kwargs")
    data["model"] = model


def routing_and_scaling_options(app_args: AppArgs) -> dict[str, Any]:
    """LLMReplica's request router and, with num_replicas="auto", its autoscaling policy."""
    from iterserve.autoscale.config import AutoscaleConfig, RouterConfig
    from iterserve.autoscale.policy import serve_autoscaling_config
    from iterserve.autoscale.router import request_router_config_dict

    engine_config = app_args.engine_config()
    model_path = Path(resolve_model_path(engine_config))
    model_name = engine_config.served_model_name or model_display_name(model_path)
    options: dict[str, Any] = {}
    if app_args.request_router_config is not None:
        options["request_router_config"] = app_args.request_router_config
    elif app_args.router != "pow2":
        options["request_router_config"] = request_router_config_dict(RouterConfig(
            model_name=model_name, prefix_affinity=app_args.router == "kv-prefix",
            prefix_block_size=engine_config.cache.block_size))
    if app_args.autoscaling_config is not None:
        options["autoscaling_config"] = app_args.autoscaling_config
    elif app_args.num_replicas == "auto":
        options["autoscaling_config"] = serve_autoscaling_config(AutoscaleConfig(
            model_name=model_name, min_replicas=app_args.min_replicas,
            max_replicas=app_args.max_replicas))
    return options


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """The iterserve application: OpenAIIngress -> LLMReplica x num_replicas."""
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    app_args.engine_config()
    replica_options: dict[str, Any] = {
        "num_replicas": app_args.num_replicas,
        "max_ongoing_requests": app_args.max_ongoing_requests,
        "ray_actor_options": replica_actor_options(app_args.num_gpus_per_replica,
                                                   app_args.num_cpus_per_replica),
        "graceful_shutdown_timeout_s": app_args.drain_timeout_s + 5,
    }
    replica_options.update(routing_and_scaling_options(app_args))
    replica = LLMReplica.options(**replica_options).bind(
        app_args.model, app_args.engine_kwargs, app_args.drain_timeout_s)
    return OpenAIIngress.options(num_replicas=app_args.num_ingress_replicas).bind(
        replica,
        api_keys=tuple(app_args.api_keys),
        api_key_file=app_args.api_key_file,
        max_body_bytes=app_args.max_body_bytes,
        model_aliases=tuple(app_args.model_aliases),
    )
