"""Kernel tests run in Triton's CPU interpreter unless a CUDA GPU is present.

TRITON_INTERPRET is read when @triton.jit decorates a function, i.e. when a kernel module is
imported, so it is set here, before any test module imports triton. torch does not import
triton, so asking torch about CUDA first is safe.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def _ensure_interpreted() -> None:
    """Fail loudly if triton was imported before TRITON_INTERPRET was set.

    triton's own @jit helpers (tl.sum, tl.cdiv, ...) are decorated when triton.language is
    first imported; if that happened without the variable, they are compiled JITFunctions
    and every interpreted kernel that calls them fails; reloading triton is not an option, so
    the fix is to set the variable earlier (tests/conftest.py or the environment).
    """
    if "triton.language" not in sys.modules:
        return
    import triton.language.standard as standard

    if type(standard.sum).__name__ != "InterpretedFunction":
        raise pytest.UsageError(
            "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
            "set TRITON_INTERPRET=1 in the environment or in tests/conftest.py on CPU machines"
        )


def _fast_interpreter_dot() -> None:
    """Make the interpreter's tl.dot use BLAS when it can, without changing its result.

    triton 3.9's interpreter computes tl.dot as np.matmul(a, b, dtype=acc_dtype); numpy
    serves a matmul with an explicit dtype from a generic loop instead of BLAS, ~500x slower
    (7.5 ms instead of 15 us for a 128x128x64 fp32 tile). Our kernels hand tl.dot fp32
    operands with an fp32 accumulator under the interpreter, so dtype= is a no-op for them and
    can be dropped; any other combination keeps the original path.
    """
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: object, a: object, b: object, d: object, *args: object) -> object:
        if a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
            return interpreter.TensorHandle(np.matmul(a.data, b.data) + d.data, d.dtype.scalar)
        return original(self, a, b, d, *args)

    interpreter.InterpreterBuilder.create_dot = create_dot


if INTERPRET:
    _ensure_interpreted()
    _fast_interpreter_dot()
