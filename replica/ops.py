"""The kernel set a model runs on, chosen once by attention backend.

Models call `self.ops.rms_norm(...)` rather than importing kernels, so one model class runs on
the plain-torch reference (CPU, tests) and on the Triton kernels (CUDA) unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Ops:
    """The six kernels a Llama-family forward needs; signatures are kernels/reference.py's."""

    name: str
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    fused_add_rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., Any]
    # (query [S, Hq, D], k_cache, v_cache, seq_lens, block_tables, scale) -> [S, Hq, D]
    paged_decode_attention: Callable[..., Any]


def _from_module(name: str, module: ModuleType) -> Ops:
    return Ops(
        name=name,
        write_kv_cache=module.write_kv_cache,
        paged_attention=module.paged_attention,
        rms_norm=module.rms_norm,
        fused_add_rms_norm=module.fused_add_rms_norm,
        rotary_embedding=module.rotary_embedding,
        silu_and_mul=module.silu_and_mul,
        paged_decode_attention=getattr(module, DECODE_ATTENTION_NAMES[name]),
    )


# The decode-only attention: flash-decoding split-KV on Triton, its reference on torch.
DECODE_ATTENTION_NAMES = {"torch": "paged_decode_attention",
                          "triton": "paged_decode_attention_split_kv"}


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
