"""Suite-wide settings, applied before any test module imports triton or builds a model.

* Without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  triton is first imported, since triton's own helpers are bound at import.
* One torch thread: the tiny models' ops are too small to split, and on a shared 2-core box
  spinning intra-op threads make timings erratic (a decode step went from 6 ms to 400 ms).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _one_offline_thread() -> Iterator[None]:
    """LLM() defaults to every core; tests keep the one thread set above (see the docstring)."""
    from iterserve.replica import llm

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm, "offline_cpu_threads", lambda: 1)
        yield
