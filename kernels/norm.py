"""RMSNorm and fused residual-add + RMSNorm, one program per row, fp32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.kernels._common import (
    FLOAT_DTYPES,
    check_device,
    check_out,
    check_shape,
    check_tensor,
    elementwise_num_warps,
    next_power_of_2,
)

# One row lives in registers; 64K fp32 values is far past any model's hidden size.
MAX_HIDDEN = 65536


@triton.jit
def rms_norm_kernel(
    x_ptr: tl.tensor,  # [T, H]
    residual_ptr: tl.tensor,  # [T, H], read only when ADD_RESIDUAL
    weight_ptr: tl.tensor,  # [H]
    out_ptr: tl.tensor,  # [T, H] contiguous
    residual_out_ptr: tl.tensor,  # [T, H] contiguous, written only when ADD_RESIDUAL
    stride_x: tl.tensor,
    stride_residual: tl.tensor,
    hidden: tl.tensor,
    eps: tl.tensor,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        summed = x + r
        # The reference rounds the sum to the activation dtype before normalising it, and the
        # engine carries the rounded residual forward; round here too so both agree bit for bit.
        summed = summed.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    # 1/sqrt instead of libdevice rsqrt keeps the kernel runnable in the interpreter.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, x * rstd * w, mask=mask)


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[int, int]:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    check_shape("weight", weight, (hidden,))
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the kernel's limit of {MAX_HIDDEN}")
    if not eps > 0.0:
        raise ValueError(f"eps must be positive, got {eps}")
    return num_tokens, hidden


def _launch(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    out: torch.Tensor,  # [T, H]
    residual_out: torch.Tensor | None,  # [T, H]
) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = next_power_of_2(hidden)
    add = residual is not None
    rms_norm_kernel[(num_tokens,)](
        x,
        residual if add else x,
        weight,
        out,
        residual_out if add else out,
        x.stride(0),
        residual.stride(0) if add else 0,
        hidden,
        float(eps),
        ADD_RESIDUAL=add,
        BLOCK=block,
        num_warps=elementwise_num_warps(block),
    )


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [T, H], optional preallocated output
) -> torch.Tensor:  # [T, H]
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype."""
    _check_norm_args(x, weight, eps)
    device = check_device(x=x, weight=weight)
    out = check_out(out, tuple(x.shape), x.dtype, device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [T, H], optional preallocated normed output
    residual_out: torch.Tensor | None = None,  # [T, H], optional; may alias residual
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual x + residual [T, H]
    """Returns (rms_norm(x + residual), x + residual) from one pass over memory."""
    _check_norm_args(x, weight, eps)
    check_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES)
    check_shape("residual", residual, tuple(x.shape))
    device = check_device(x=x, residual=residual, weight=weight)
    out = check_out(out, tuple(x.shape), x.dtype, device)
    # Each program reads its row of residual before writing the same row of residual_out, so
    # writing the sum back into a contiguous residual buffer in place is safe.
    residual_out = check_out(residual_out, tuple(x.shape), x.dtype, device)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
