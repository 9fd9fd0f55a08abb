"""CPU linears through oneDNN with weights packed once, as vLLM's CPU backend runs them.

fp32 `F.linear` on CPU dispatches to MKL's sgemm, which on the AMD EPYC this project measures
on runs 1.1-2.7x slower than oneDNN's matmul with the weight reordered once into its blocked
layout (BENCHMARKS.md, "CPU engine paths"). vLLM's CPU build does the same
(`dispatch_cpu_unquantized_gemm` -> `onednn_mm`). Here each `Linear` of a model on CPU gets
`torch.ops.mkldnn._reorder_linear_weight(weight)` once after load (the tied lm_head too: its
packed copy is separate from the embedding table), and its forward calls
`torch.ops.mkldnn._linear_pointwise` with it.

A start-up self-check runs every packed linear against `F.linear` on seeded inputs; if any
differs beyond rounding (or the ops are missing or fail), every linear goes back to
`F.linear` and a warning says why. CUDA never packs: F.linear stays there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.replica.models.layers import Linear

logger = logging.getLogger(__name__)

# Relative error allowed against F.linear: summation order differs, nothing else does. fp32
# measures ~1e-6 at SmolLM2's shapes; bf16 products are rounded to bf16 by both libraries.
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
CHECK_ROWS = (1, 7, 33)  # decode-sized and odd row counts: oneDNN picks kernels by shape


def pack_linears(model: nn.Module, mode: str,
                 copied: Callable[[int], None] = lambda nbytes: None) -> str:
    """Pack every Linear of a CPU model for oneDNN when `mode` is "onednn"; the path that
    runs, as the benchmarks print it: "onednn", "torch", or "torch (fallback: why)".
    `copied` is told the bytes of each packed copy (start-up's weights_pack stage)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    if mode != "onednn":
        return "torch"
    try:
        for _, module in linears:
            module.packed = pack_weight(module.weight)
            copied(module.weight.nbytes)  # the packed copy holds as many values
        mismatch = _self_check(linears)
    except (RuntimeError, AttributeError) as error:  # an op missing from this torch build
        mismatch = f"oneDNN linear failed: {error}"
    if mismatch is None:
        return "onednn"
    for _, module in linears:
        module.packed = None
    logger.warning("CPU linears fall back to F.linear: %s", mismatch)
    return f"torch (fallback: {mismatch})"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> oneDNN's blocked layout
    """The weight reordered once for oneDNN's matmul (no batch-size hint: measured the same)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _self_check(linears: list[tuple[str, Linear]]) -> str | None:
    """None when every packed linear matches F.linear on seeded inputs, else what differs."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, module in linears:
            weight = module.weight
            rtol = CHECK_RTOL.get(weight.dtype, 2e-2)
            for rows in CHECK_ROWS:
                x = torch.randn((rows, weight.shape[1]), generator=gen).to(weight.dtype)
                want = F.linear(x, weight, module.bias).float()  # [rows, out]
                got = module(x).float()  # [rows, out]
                error = float((got - want).abs().max())
                bound = rtol * max(1.0, float(want.abs().max()))
                if not error <= bound:  # also catches NaN
                    return (f"{name} at {rows} rows differs from F.linear by {error:.3g} "
                            f"(allowed {bound:.3g})")
    return None
