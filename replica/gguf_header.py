"""A GGUF file's header (metadata and tensor records) read in one pass, without the gguf
package's reader.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value: on the built-in
SmolLM2 file (49,152 vocabulary strings, 48,900 merges) that is 2.3 s of a replica's start
(replica_startup study). This reader walks the same format (GGUF v2/v3, little-endian, spec:
ggml-org/ggml docs/gguf.md) with `struct` over a memory map and decodes the big string arrays
with one loop each: the same values (`tests/unit/test_gguf_header.py` compares every field and
tensor with GGUFReader's), in ~0.1 s. Tensor data stay views of the map, shaped as GGUFReader
shapes them (quantized types as rows of bytes), so `gguf.quants.dequantize` takes them as is.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (gguf.GGUFValueType): struct format and size of each scalar type.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_DENSE = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as GGUFReader describes it: `shape` fastest dimension first (GGUF order),
    `data` a view of the file shaped for `gguf.quants.dequantize`."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.at = 0

    def unpack(self, fmt: str) -> Any:  # noqa: ANN401
        value = struct.unpack_from(fmt, self.buffer, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buffer[self.at:self.at + n]
        if len(raw) != n:
            raise ValueError("a string runs past the end of the file")
        self.at += n
        return raw.decode("utf-8")

    def value(self, kind: int) -> Any:  # noqa: ANN401
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _NUMPY:  # a run of fixed-size scalars: one numpy read
            values = np.frombuffer(self.buffer, dtype=_NUMPY[item], count=count, offset=self.at)
            self.at += values.nbytes
            return values.tolist()
        return [self.value(item) for _ in range(count)]


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, TensorRecord],
                                                 np.memmap]:
    """(metadata {key: value}, tensors {name: TensorRecord}, the file's memmap). Raises
    ValueError for a file that is not little-endian GGUF v2/v3, or is truncated."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer)
        try:
            if cursor.unpack("<4s") != b"GGUF":
                raise ValueError("not a GGUF file")
            version = cursor.unpack("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (big-endian, or v1) is not supported")
            num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
            fields: dict[str, Any] = {}
            for _ in range(num_fields):
                key = cursor.string()
                fields[key] = cursor.value(cursor.unpack("<I"))
            infos = []
            for _ in range(num_tensors):
                name = cursor.string()
                dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
                infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
        except struct.error as error:
            raise ValueError(f"the header runs past the end of the file: {error}") from error
        alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cursor.at // alignment) * alignment
    tensors: dict[str, TensorRecord] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        kind = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[kind]
        elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        dense = _DENSE.get(kind.name)
        if dense is not None:
            count, dtype = elements, np.dtype(dense)
        else:
            count, dtype = elements * type_size // block, np.dtype(np.uint8)
            shape = quant_shape_to_byte_shape(shape, kind)
        at = start + offset
        if at + count * dtype.itemsize > data.size:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        view = data[at:at + count * dtype.itemsize].view(dtype).reshape(shape)
        tensors[name] = TensorRecord(name, kind, np.array(dims, dtype=np.uint64), view)
    return fields, tensors, data
