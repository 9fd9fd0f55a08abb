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


def _scalar_index_on_numpy_2_4() -> None:
    """Let an older interpreter (triton 3.6) use a scalar tensor as a Python int on numpy >= 2.4.

    The interpreter holds a scalar as a shape-(1,) array. triton 3.6 turns it into an int with
    int(array), which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"), so every `for tile in range(start, end, step)` over runtime bounds dies; triton
    3.9 squeezes the array first. Do what 3.9 does (a no-op there). A GPU compiles the kernels
    and never meets this; the GPU machine's numpy is 2.5.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: type, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    _ensure_interpreted()
    _fast_interpreter_dot()
    _scalar_index_on_numpy_2_4()
