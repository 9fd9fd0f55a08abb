"""A kernel launch described as data, so the launcher and the ahead-of-time compiler share it.

Launchers build a Launch (kernel, grid, runtime args, constexprs, warps, stages) and run it;
`kernels/aot.py` builds the same Launch from host-only tensors of the shapes the engine uses
and hands it to triton's own argument binder, so the checked sm_90 build is exactly the
specialisation the runtime JIT would compile (same 16-divisibility marks, same constexprs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Launch:
    name: str  # what the report calls this specialisation
    kernel: Any  # a triton JITFunction (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple[Any, ...]  # runtime arguments, in the kernel's order
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int

    def run(self) -> None:
        self.kernel[self.grid](
            *self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages
        )
