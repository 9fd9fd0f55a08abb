"""GGUF tensors dequantised straight into the model's parameters: no dense copy in between.

`write_into(record, dest, heads, copied)` fills `dest` (a parameter, or the rows of a fused
one, in HF layout) from a GGUF tensor record (replica/gguf_header.py: a view of the file's
map). With `heads`, the Q/K rows llama.cpp permuted are put back while writing: `dest` is
viewed in the file's row order (`unpermute_rotary_rows` as a strided view), so no unpermuted
copy is made either. F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (the built-in SmolLM2's types) are
computed with torch, chunk by chunk, the arithmetic in gguf.quants' order (same float32
values, bit for bit: tests/unit/test_gguf_dequant.py); any other type goes through
gguf.quants.dequantize into a dense buffer first (`copied` hears of it). Where `dest` is not
float32 on the CPU each chunk is computed in a float32 scratch and rounded (or sent) once, as
the dense path does.

Before (replica_startup study, built-in file, fp32): numpy dequantised every tensor into a
new buffer, Q/K rows were unpermuted into another, and the result was copied into the
parameter: 1129 MB written for 540 MB of parameters, 1.1-1.3 s.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from iterserve.replica.gguf_header import TensorRecord

FAST_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
BLOCK = 32  # values per block of the legacy quant types
ROWS_PER_CHUNK = 64  # rows computed at a time: temporaries stay in cache


def _source(record: TensorRecord) -> torch.Tensor:
    """The record's bytes (or values) as a torch view of the read-only map; nothing writes it."""
    with warnings.catch_warnings():  # "the given NumPy array is not writable"
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(record.data)


def _file_order(dest: torch.Tensor, heads: int | None) -> torch.Tensor:
    """`dest` viewed in the file's row order: with `heads`, llama.cpp's interleaved pairs
    (the inverse of `unpermute_rotary_rows`), else `dest` itself."""
    if heads is None:
        return dest
    rows = dest.shape[0]
    return dest.view(heads, 2, rows // heads // 2, *dest.shape[1:]).transpose(1, 2)


def _blocks(values: torch.Tensor) -> torch.Tensor:
    return values.unflatten(-1, (values.shape[-1] // BLOCK, BLOCK))


def _half(raw: torch.Tensor) -> torch.Tensor:
    """fp16 scales stored as two bytes at the start of each block, as float32 (..., nb, 1)."""
    return raw.contiguous().view(torch.float16).float()


def _dequantize_chunk(kind: str, raw: torch.Tensor, out: torch.Tensor) -> None:
    """raw: (..., nb, block bytes) uint8; out: (..., nb, 32) float32, written in place."""
    if kind == "Q8_0":  # d, 32 x int8: x * d
        torch.mul(raw[..., 2:].view(torch.int8), _half(raw[..., :2]), out=out)
    elif kind == "Q4_0":  # d, 16 bytes of nibbles: d * (q - 8), low nibbles first
        scale, quants = _half(raw[..., :2]), raw[..., 2:]
        torch.mul(scale, (quants & 0x0F).view(torch.int8) - 8, out=out[..., :BLOCK // 2])
        torch.mul(scale, (quants >> 4).view(torch.int8) - 8, out=out[..., BLOCK // 2:])
    elif kind == "Q4_1":  # d, m, 16 bytes of nibbles: d * q + m, low nibbles first
        scale, low, quants = _half(raw[..., :2]), _half(raw[..., 2:4]), raw[..., 4:]
        torch.mul(scale, quants & 0x0F, out=out[..., :BLOCK // 2]).add_(low)
        torch.mul(scale, quants >> 4, out=out[..., BLOCK // 2:]).add_(low)
    else:
        raise ValueError(f"no fast path for {kind}")


def _chunks(target: torch.Tensor, source: torch.Tensor) -> list[tuple[torch.Tensor,
                                                                     torch.Tensor]]:
    """Matching (target, source) pieces: ROWS_PER_CHUNK rows, or one head (file order)."""
    if target.dim() <= 1:
        return [(target, source)]
    if target.dim() > 2:
        return list(zip(target, source, strict=True))
    return [(target[i:i + ROWS_PER_CHUNK], source[i:i + ROWS_PER_CHUNK])
            for i in range(0, target.shape[0], ROWS_PER_CHUNK)]


def dequantize_numpy(record: TensorRecord) -> np.ndarray:
    """gguf.quants' dequantisation of one record: a dense float32 array, GGUF's shape reversed
    (the fallback of `write_into` for the types it has no fast path for)."""
    import gguf

    try:
        values = gguf.quants.dequantize(record.data, record.tensor_type)
    except (ValueError, IndexError) as e:
        raise ValueError(f"tensor {record.name!r} cannot be read (truncated or corrupt "
                         f"file?): {e}") from e
    shape = tuple(int(d) for d in reversed(record.shape))  # GGUF lists the fastest dim first
    if values.size != int(np.prod(shape)):
        raise ValueError(f"tensor {record.name!r} holds {values.size} values, expected {shape}")
    return np.require(values, dtype=np.float32, requirements=["C", "W"]).reshape(shape)


def write_into(record: TensorRecord, dest: torch.Tensor, heads: int | None = None,
               copied: Callable[[int], None] | None = None) -> None:
    """Fill `dest` with the record's values (see the module docstring)."""
    kind = record.tensor_type.name
    target = _file_order(dest, heads)
    if kind not in FAST_TYPES:
        values = torch.from_numpy(dequantize_numpy(record)).view(target.shape)
        if copied is not None:
            copied(values.nbytes)
        target.copy_(values)
        return
    source = _source(record)
    if kind == "BF16":
        source = source.view(torch.bfloat16)
    quantized = kind not in ("F32", "F16", "BF16")
    if quantized:  # rows of blocks, in the target's leading shape
        source = source.view(*target.shape[:-1], target.shape[-1] // BLOCK, -1)
    else:
        source = source.view(target.shape)
    for piece, raw in _chunks(target, source):
        if not quantized:
            piece.copy_(raw)
        elif piece.dtype == torch.float32 and piece.device.type == "cpu":
            _dequantize_chunk(kind, raw, _blocks(piece))
        else:  # in float32 on the CPU, then rounded once into the parameter (its device)
            scratch = torch.empty(piece.shape, dtype=torch.float32)
            _dequantize_chunk(kind, raw, _blocks(scratch))
            piece.copy_(scratch)
            if copied is not None:
                copied(scratch.nbytes)
