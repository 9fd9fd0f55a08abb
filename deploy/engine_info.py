"""Engine-side helpers shared by the Serve replica and the in-process client (no Ray here).

`load_signals` is the one place that turns EngineStats into the flat numeric dict that the
router (`record_routing_stats`) and the autoscaler (`record_autoscaling_stats`) read.
`stream_engine` wraps `AsyncLLMEngine.generate` so that engine errors raised before the first
output travel as `EngineErrorInfo` records and the request is always aborted on early exit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from iterserve.deploy.errors import EngineErrorInfo, engine_error_info
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.stats import EngineStats


def load_signals(stats: EngineStats, draining: bool = False) -> dict[str, float]:
    """The engine's load as numbers: what routers and autoscaling policies consume.

    Keys: kv_usage (0..1), num_waiting, num_running, num_free_blocks, num_total_blocks,
    num_preemptions (cumulative), step_token_rate (tokens/s), max_waiting_requests (-1 when
    unbounded), draining (1.0 while the engine admits nothing new), timestamp (time.time()
    of the snapshot). All values are floats so that `record_autoscaling_stats` accepts them;
    `iterserve.autoscale.signals.ReplicaLoad.from_dict` parses this dict.
    """
    return {
        "kv_usage": float(stats.kv_usage),
        "num_waiting": float(stats.num_waiting),
        "num_running": float(stats.num_running),
        "num_free_blocks": float(stats.num_free_blocks),
        "num_total_blocks": float(stats.num_total_blocks),
        "num_preemptions": float(stats.num_preemptions),
        "step_token_rate": float(stats.step_token_rate),
        "max_waiting_requests": float(-1 if stats.max_waiting_requests is None
                                      else stats.max_waiting_requests),
        "draining": 1.0 if draining else 0.0,
        "timestamp": float(stats.timestamp),
    }


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
    try:
        from iterserve.replica.model_source import resolve_model_path as resolve
    except ImportError:
        return None
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
        "stats": load_signals(stats, bool(getattr(engine, "is_draining", False))),
    }
    info.update(extra or {})
    return info


async def stream_engine(
    engine: Any,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    priority: int = 0,
) -> AsyncIterator[RequestOutput | EngineErrorInfo]:
    """Yield the engine's deltas; an engine error before the first one is yielded as data.

    Closing this generator early (client disconnect: Serve injects CancelledError) closes the
    engine's generator, which aborts the request and frees its KV blocks.
    """
    agen = engine.generate(prompt_token_ids, params, request_id, priority=priority)
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
