"""The CPU suite must really exercise Triton kernels through the interpreter, not fall back."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
from kernel_testlib import INTERPRET

from iterserve.kernels import ops

KERNEL_MODULES = ["kv_cache", "norm", "rotary", "activation", "attention_core", "paged_attention", "split_kv"]


def _kernels() -> dict[str, object]:
    found = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"iterserve.kernels.{name}")
        for attr, value in vars(module).items():
            if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                found[f"{name}.{attr}"] = value
    return found


def test_every_kernel_module_defines_kernels() -> None:
    kernels = _kernels()
    for name in KERNEL_MODULES:
        assert any(key.startswith(f"{name}.") for key in kernels), name


@pytest.mark.skipif(not INTERPRET, reason="compiled run on a GPU")
def test_kernels_are_interpreted() -> None:
    assert triton.knobs.runtime.interpret
    kinds = {name: type(k).__name__ for name, k in _kernels().items()}
    assert set(kinds.values()) == {"InterpretedFunction"}, kinds


@pytest.mark.skipif(not INTERPRET, reason="compiled run on a GPU")
def test_launch_goes_through_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Count the interpreter's grid executions: a launch that silently used torch would not.
    from triton.runtime import interpreter

    calls = []
    original = interpreter.GridExecutor.__call__

    def counting(self: object, *args: object, **kwargs: object) -> object:
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counting)
    x = torch.randn(3, 8)
    ops.silu_and_mul(x)
    assert len(calls) == 1
