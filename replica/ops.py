"""The kernel set a model runs on, chosen once by attention backend.

Models call `self.ops.rms_norm(...)` rather than importing kernels, so one model class runs on
the plain-torch reference (CPU, tests) and on the Triton kernels (CUDA) unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Ops:
    """The kernels a Llama-family forward needs; signatures are kernels/reference.py's.

    paged_attention also takes the keyword-only launch hints num_decodes, num_kv_splits,
    split_work and prefill_work (AttentionMetadata); the torch reference ignores them (they
    change launches, not math).
    """

    name: str
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    fused_add_rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., Any]


def _from_module(name: str, module: ModuleType) -> Ops:
    return Ops(
        name=name,
        write_kv_cache=module.write_kv_cache,
        paged_attention=(module.paged_attention if name == "triton"
                         else _ignoring_launch_hints(module.paged_attention)),
        rms_norm=module.rms_norm,
        fused_add_rms_norm=module.fused_add_rms_norm,
        rotary_embedding=module.rotary_embedding,
        silu_and_mul=module.silu_and_mul,
    )


def _ignoring_launch_hints(attention: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(attention)
    def paged_attention(*args: Any, num_decodes: int = 0, num_kv_splits: int = 1,
                        split_work: Any = None, prefill_work: Any = None) -> Any:
        return attention(*args)

    return paged_attention


def select_ops(attention_backend: str) -> Ops:
    """"torch" -> kernels.reference; "triton" -> kernels.ops ("auto" is resolved by the caller)."""
    if attention_backend == "torch":
        from iterserve.kernels import reference

        return _from_module("torch", reference)
    if attention_backend == "triton":
        # Imported here so that torch-only use (CPU, tests) never imports triton.
        from iterserve.kernels import ops

        return _from_module("triton", ops)
    raise ValueError(
        f"unknown attention backend {attention_backend!r}; choose one of {', '.join(BACKENDS)}"
    )
