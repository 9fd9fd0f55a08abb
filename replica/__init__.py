"""The engine: config, requests, block manager, scheduler, runners, engines, offline LLM.

Public names are imported lazily, so that pure-Python parts (scheduler, block manager) load
without torch or the model code.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncLLMEngine": "iterserve.replica.async_engine",
    "CacheConfig": "iterserve.replica.config",
    "EngineConfig": "iterserve.replica.config",
    "SchedulerConfig": "iterserve.replica.config",
    "LLM": "iterserve.replica.llm",
    "CompletionOutput": "iterserve.replica.llm",
    "GenerationResult": "iterserve.replica.llm",
    "LLMEngine": "iterserve.replica.llm_engine",
    "RequestOutput": "iterserve.replica.outputs",
    "SamplingParams": "iterserve.replica.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'iterserve.replica' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
