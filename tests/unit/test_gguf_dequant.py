"""GGUF tensors dequantised straight into their parameters (replica/gguf_dequant.py) hold the
very float32 values gguf.quants' numpy path gives, bit for bit, for every type with a torch
fast path, Q/K rows unpermuted on the way (llama.cpp's permutation undone as a strided view
of the parameter); other types go through the numpy path; nothing but the parameter is written
on the fast path."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_testlib import llama_cpp_permute

from iterserve.replica.gguf_dequant import FAST_TYPES, dequantize_numpy, write_into
from iterserve.replica.gguf_header import read_gguf_header

HEADS, HEAD_DIM, COLS = 4, 16, 96  # 64 rows, 3 blocks of 32 per row


def gguf_file(tmp_path: Path, tensor_type: str, values: np.ndarray) -> Path:
    """One tensor "w" of `tensor_type` holding `values` (quantised as llama.cpp does)."""
    path = tmp_path / f"{tensor_type}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F32":
        writer.add_tensor("w", values)
    elif tensor_type == "F16":
        writer.add_tensor("w", values.astype(np.float16))
    else:
        writer.add_tensor("w", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tensor_type", [*FAST_TYPES, "Q5_0"])
@pytest.mark.parametrize("permuted", [False, True])
def test_written_values_equal_ggufs_dequantisation(tmp_path: Path, tensor_type: str,
                                                    permuted: bool) -> None:
    rng = np.random.default_rng(7)
    hf = (rng.standard_normal((HEADS * HEAD_DIM, COLS)) * 0.1).astype(np.float32)
    stored = llama_cpp_permute(hf, HEADS) if permuted else hf
    _, tensors, _ = read_gguf_header(gguf_file(tmp_path, tensor_type, stored))
    record = tensors["w"]
    dense = dequantize_numpy(record)  # gguf.quants' values, in the file's row order
    expected = dense.reshape(HEADS, HEAD_DIM // 2, 2, COLS).swapaxes(1, 2).reshape(
        dense.shape) if permuted else dense
    written: list[int] = []
    dest = torch.full(dense.shape, float("nan"))
    write_into(record, dest, HEADS if permuted else None, written.append)
    assert np.array_equal(dest.numpy(), expected)  # bit for bit, every element written
    assert sum(written) == (0 if tensor_type in FAST_TYPES else dense.nbytes)
    if tensor_type == "F32":  # the permutation undone really is llama.cpp's
        assert np.array_equal(dest.numpy(), hf)
    half = torch.empty(dense.shape, dtype=torch.bfloat16)  # rounded once, as the dense path
    write_into(record, half, HEADS if permuted else None)
    assert torch.equal(half, torch.from_numpy(np.ascontiguousarray(expected)).bfloat16())


def test_a_fused_destination_is_filled_in_place(tmp_path: Path) -> None:
    """The rows of a fused parameter (qkv): a narrow view, written without a copy."""
    rng = np.random.default_rng(8)
    values = rng.standard_normal((64, COLS)).astype(np.float32)
    _, tensors, _ = read_gguf_header(gguf_file(tmp_path, "Q4_1", values))
    fused = torch.zeros(3 * 64, COLS)
    write_into(tensors["w"], fused.narrow(0, 64, 64))
    assert np.array_equal(fused[64:128].numpy(), dequantize_numpy(tensors["w"]))
    assert fused[:64].abs().sum() == 0 and fused[128:].abs().sum() == 0
