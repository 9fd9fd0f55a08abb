"""Engine-side helpers shared by the Serve replica and the in-process client (no Ray here).

`describe_engine` is what `/debug/replicas` and the ingress read of one engine (its load as
`ReplicaLoad.to_dict()`, the same record the router reads).
`stream_engine` wraps `AsyncLLMEngine.generate` so that engine errors raised before the first
output travel as `EngineErrorInfo` records and the request is always aborted on early exit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from iterserve.autoscale.signals import ReplicaLoad
from iterserve.deploy.errors import EngineErrorInfo, engine_error_info
from iterserve.replica.block_keys import CacheNamespace
from iterserve.replica.lora_adapter import LoRACheck, LoRARequest
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.request import TenantShare
from iterserve.replica.sampling_params import SamplingParams


def flat_config(config: Any) -> dict[str, Any]:
    """EngineConfig's values in one flat dict (cache.* and scheduler.* lifted up)."""
    flat: dict[str, Any] = {}
    for key, value in dataclasses.asdict(config).items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def resolve_model_path(config: Any) -> str | None:
    """The model file or folder the engine loaded: config.model resolved, or the built-in one."""
    from iterserve.replica.model_source import resolve_model_path as resolve

    return str(resolve(getattr(config, "model", None)))


def describe_engine(engine: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the ingress and tests need to know about one engine, as plain data."""
    config = engine.config
    stats = engine.stats()
    tokenizer = engine.tokenizer
    info = {
        "model_name": engine.model_name,
        "model_path": resolve_model_path(config),
        "max_model_len": config.scheduler.max_model_len,
        "max_logprobs": config.max_logprobs,
        "vocab_size": getattr(tokenizer, "vocab_size", None),
        "config": {**flat_config(config), "num_gpu_blocks": stats.num_total_blocks},
        "stats": ReplicaLoad.from_engine_stats(
            stats, bool(getattr(engine, "is_draining", False))
        ).with_adapters(engine.resident_loras()).to_dict(),  # as the router reads them
        # Requests ended per finish reason, from the same snapshot as "stats": what
        # /metrics' request_success_total must agree with.
        "finished_by_reason": dict(stats.finished_by_reason),
        # The engine's start-up stages (replica/startup.py); a Serve replica adds its own.
        "startup": {"stages": engine.startup.as_dict()},
    }
    info.update(extra or {})
    return info


async def stream_engine(
    engine: Any,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    priority: int = 0,
    cache_namespace: CacheNamespace = b"",
    lora_request: LoRARequest | None = None,
    tenant: TenantShare | None = None,
    lora_still_loaded: LoRACheck | None = None,
) -> AsyncIterator[RequestOutput | EngineErrorInfo]:
    """Yield the engine's deltas; an engine error before the first one is yielded as data.
    `lora_still_loaded`: the cluster's registry, asked before an adapter is read back.

    Closing this generator early (client disconnect: Serve injects CancelledError) closes the
    engine's generator, which aborts the request and frees its KV blocks.
    """
    agen = engine.generate(prompt_token_ids, params, request_id, priority=priority,
                           cache_namespace=cache_namespace, lora_request=lora_request,
                           tenant=tenant, lora_still_loaded=lora_still_loaded)
    try:
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            return
        except Exception as error:  # noqa: BLE001 - mapped below, re-raised if unknown
            info = engine_error_info(error)
            if info is None:
                raise
            yield info  # never admitted: nothing to abort
            return
        yield first
        async for out in agen:
            yield out
    finally:
        # The engine's generator aborts an unfinished request (frees its blocks) on close.
        await agen.aclose()


async def lora_adapter_action(engine: Any, action: str, name: str,  # noqa: ANN401
                              path: str | None) -> EngineErrorInfo | None:
    """Load ("load", from `path`) or unload ("unload") an adapter on one engine; an engine
    error (a malformed adapter, one still in use, one it lacks) comes back as data."""
    try:
        if action == "load" and path is not None:
            await engine.load_lora(name, path)
        elif action == "unload":
            await engine.unload_lora(name)
        else:
            raise ValueError(f"unknown LoRA adapter action {action!r}")
    except Exception as error:  # noqa: BLE001 - mapped below, re-raised if unknown
        info = engine_error_info(error)
        if info is None:
            raise
        return info
    return None
