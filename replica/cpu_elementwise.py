"""The elementwise ops between a CPU layer's GEMMs, fused by inductor for prefill-sized batches.

kernels/reference.py writes RMSNorm, rotary and SiLU*mul as plain torch ops: each op is one
pass over a [T, H]-sized tensor and a fresh allocation, so a layer makes about twenty passes
where a fused kernel makes four. In a 512-token SmolLM2 chunk on the 2-core EPYC these ops
took ~12 % of the forward (torch.profiler; loadtests/studies/engine_speed/README.md). Here
each of them runs as one compiled function, T marked dynamic, one graph per op and model
shape (shared by engines of the same shape in a process, and cached on disk by inductor).

Below `COMPILED_FROM_TOKENS` tokens (decode steps) the eager ops run: a compiled call costs
~15-20 us of guards and launch, as much as the eager ops save at T = 32 (measured).

The math is the reference's, so the results are the reference's up to summation order (the
rotary and SiLU*mul bit-identical, the norms within 1e-6). A compile that fails falls back to
the eager ops with one warning, and `path` says so.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from iterserve.kernels import reference
from iterserve.replica.ops import Ops

logger = logging.getLogger(__name__)

COMPILED_FROM_TOKENS = 64  # fewer tokens: the eager ops (guard cost ~ what fusion saves)
RECOMPILE_LIMIT = 64  # each model shape compiles its own graphs (tests build many)


def rotate_heads(positions: torch.Tensor, heads: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> None:
    """reference.rotary_embedding's rotation of one [T, heads, D] tensor, in place: here the
    query and key heads together (they lie side by side in the fused q/k/v rows)."""
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, D]
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # [T, 1, D/2]
    x = heads.float()
    rotated = (x * torch.cat((cos, cos), dim=-1)
               + torch.cat((x[..., half:], x[..., :half]), dim=-1) * torch.cat((-sin, sin), -1))
    heads.copy_(rotated)


@functools.cache
def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` under torch.compile, one wrapper per function and process (dynamo keys graphs by
    function: engines of one model shape share them). Sizes are static unless the caller
    marks them dynamic."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


def joint_heads(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The [T, Hq + Hkv, D] view covering `query` and `key` when the key heads directly follow
    the query heads in memory with the same strides (views of the fused q/k/v rows); None
    otherwise."""
    if (query.dim() != 3 or query.stride() != key.stride() or query.dtype != key.dtype
            or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]):
        return None
    heads_stride = query.stride(1)
    if key.data_ptr() != query.data_ptr() + query.shape[1] * heads_stride * query.element_size():
        return None
    return query.as_strided((query.shape[0], query.shape[1] + key.shape[1], query.shape[2]),
                            query.stride())


class CpuElementwise:
    """The fused elementwise ops of one CPU engine: its setting, what ran, compile time."""

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "compiled" or "eager"
        self.note = ""  # why the compiled ops fell back, when they did
        self.compile_seconds = 0.0

    @property
    def path(self) -> str:
        return self.mode + (f" (fallback: {self.note})" if self.note else "")

    def ops(self, base: Ops) -> Ops:
        """`base` (the torch reference ops) with these elementwise ops; unchanged when eager."""
        if self.mode != "compiled":
            return base
        return dataclasses.replace(base, rms_norm=self.rms_norm,
                                   fused_add_rms_norm=self.fused_add_rms_norm,
                                   rotary_embedding=self.rotary_embedding,
                                   silu_and_mul=self.silu_and_mul)

    def _run(self, fn: Callable[..., Any], num_tokens: int, *args: Any) -> Any:
        """`fn` compiled with dim 0 of every tensor argument dynamic (the tokens), when the
        compiled path is on and the batch is prefill-sized; else `fn` eagerly."""
        if self.mode != "compiled" or num_tokens < COMPILED_FROM_TOKENS:
            return fn(*args)
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        if positions := [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 1]:
            torch._dynamo.maybe_mark_dynamic(positions[0], 0)  # rotary's [T] positions
        try:
            return compiled(fn)(*args)
        except Exception as error:  # inductor and the C++ compiler raise many types: any
            # failure means the compiled ops are gone for this engine; the eager ones are exact
            self.mode = "eager"
            first_line = (str(error).splitlines() or [""])[0]
            self.note = f"{type(error).__name__}: {first_line[:200]}"
            logger.warning("CPU elementwise ops fall back to eager torch: %s", self.note)
            return fn(*args)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._run(reference.rms_norm, x.shape[0], x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(reference.fused_add_rms_norm, x.shape[0], x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(reference.silu_and_mul, x.shape[0], x)

    def rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> None:
        """In place, as reference.rotary_embedding. Compiled over the query and key heads as
        one view: two mutated views of one base would make AOT autograd build a synthetic base
        whose size it bakes in."""
        heads = joint_heads(query, key)
        if heads is None:
            reference.rotary_embedding(positions, query, key, cos_sin_cache)
            return
        self._run(rotate_heads, heads.shape[0], positions, heads, cos_sin_cache)

    @torch.inference_mode()  # as the engine's steps run: grad mode is part of dynamo's guards
    def warm_up(self, hidden_size: int, intermediate_size: int, num_heads: int,
                num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                norm_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor) -> None:
        """Compile every op now, as the model will call it, not on the first prefill; times it.
        Two token counts: dynamo compiles the first size it sees static."""
        if self.mode != "compiled":
            return
        start = time.perf_counter()
        for tokens in (COMPILED_FROM_TOKENS, COMPILED_FROM_TOKENS + 1):
            x = torch.zeros((tokens, hidden_size), dtype=dtype)
            self.rms_norm(x, norm_weight, eps)
            self.fused_add_rms_norm(x, x.clone(), norm_weight, eps)
            self.silu_and_mul(torch.zeros((tokens, 2 * intermediate_size), dtype=dtype))
            qkv = torch.zeros((tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype=dtype)
            q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                                 num_kv_heads * head_dim], dim=-1)
            self.rotary_embedding(torch.arange(tokens), q.view(tokens, num_heads, head_dim),
                                  k.view(tokens, num_kv_heads, head_dim), cos_sin_cache)
        self.compile_seconds = time.perf_counter() - start
