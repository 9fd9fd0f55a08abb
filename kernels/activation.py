"""SiLU-and-mul, SwiGLU's activation: silu(gate) * up with x = [gate | up]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import (
    FLOAT_DTYPES,
    check_device,
    check_out,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def silu_and_mul_kernel(
    x_ptr: tl.tensor,  # [T, 2I]
    out_ptr: tl.tensor,  # [T, I] contiguous
    stride_x: tl.tensor,
    inter: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g), written with exp so no libdevice call is needed; exp of
    # -|g| never overflows, and sigmoid(-|g|) = e / (1 + e) covers the negative side.
    e = tl.exp(-tl.abs(gate))
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    silu = gate * sigmoid
    tl.store(out_ptr + row * inter + cols, silu * up, mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2I]
    *,
    out: torch.Tensor | None = None,  # [T, I], optional preallocated output
) -> torch.Tensor:  # [T, I]
    """silu(x[:, :I]) * x[:, I:], computed in fp32, returned in x's dtype."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = x.shape
    if width % 2 != 0:
        raise ValueError(f"x's last dim must be even ([gate | up]), got {width}")
    inter = width // 2
    device = check_device(x=x)
    out = check_out(out, (num_tokens, inter), x.dtype, device)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(next_power_of_2(inter), 1024)
    grid = (num_tokens, triton.cdiv(inter, block))
    silu_and_mul_kernel[grid](x, out, x.stride(0), inter, BLOCK=block, num_warps=4)
    return out
