"""Helpers shared by the launchers: input validation, launch heuristics, interpreter detection.

Launchers validate everything they can check on the host without a device sync (dtype, shape,
strides, device) and raise ValueError. Values inside device tensors (slot ids, block ids,
positions, sequence lengths) are trusted: checking them would cost a GPU->CPU sync every step.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

# Used when no CUDA device can be queried (interpreter runs): the H100/H200 SM count.
DEFAULT_NUM_SMS = 132

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    last_dim_contiguous: bool = True,
) -> torch.Tensor:
    """Check one launcher argument and return it typed; raise ValueError with a clear message."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    allowed = tuple(dtypes)
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must have dtype in ({names}), got {tensor.dtype}")
    # Kernels address the last dim with unit stride, so it must be dense (size-1 dims are free).
    if last_dim_contiguous and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")
    return tensor


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def check_work_list(name: str, work: object, device: torch.device) -> None:
    """A work list (work_lists.py): a contiguous [P, 2] index tensor on the launch's device."""
    check_tensor(name, work, ndim=2, dtypes=INDEX_DTYPES)
    check_shape(name, work, (work.shape[0], 2))
    check_contiguous(name, work)
    if work.device != device:
        raise ValueError(f"{name} must be on {device}, got {work.device}")


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; CUDA unless the interpreter runs (it also takes CPU tensors)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{n}={t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    device = devices.pop()
    if device.type != "cuda" and not is_interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; use iterserve.kernels.reference on "
            "CPU, or set TRITON_INTERPRET=1 before importing triton to run the interpreter"
        )
    return device


def check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Use a caller-provided output buffer (CUDA graphs, tests) or allocate a fresh one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    check_shape("out", out, shape)
    if out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be {dtype} on {device}, got {out.dtype} on {out.device}")
    check_contiguous("out", out)
    return out


def dot_dtype(cache_dtype: torch.dtype) -> tl.dtype:
    """The dtype tl.dot operands are cast to.

    Kernels upcast every load to fp32. On a GPU the dot operands go back to the cache's 16-bit
    dtype so tl.dot runs on tensor cores (fp32 accumulation); fp32 caches keep fp32 operands.
    The interpreter cannot multiply bf16 (it multiplies raw bit patterns), so it always gets
    fp32 operands, which numpy multiplies exactly.
    """
    if is_interpreting():
        return tl.float32
    return _TL_DTYPES[cache_dtype]


def num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def elementwise_num_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel of `block` elements (the Liger/unsloth rule)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4
