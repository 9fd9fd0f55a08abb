"""Every kernel specialisation the engine can launch compiles for sm_90 (H100/H200), fits,
and has its KV loops software-pipelined, proven from the compiled code without a GPU.

The interpreter checks none of tl.dot's shape rules, layouts, shared-memory limits or
pipelining, so this runs `iterserve.kernels.aot`: it compiles each specialisation exactly as
the runtime JIT would (same divisibility marks, same constexprs) down to a cubin with the
ptxas that ships in the triton wheel. It runs in a subprocess without TRITON_INTERPRET
(which this directory's conftest sets, and under which kernels cannot be compiled). ~110
compiles: about 1.5 CPU-minutes, longer on a shared box (triton's cache makes reruns fast).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.fixture(scope="module")
def compiled() -> list[dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the GPU default; also silences triton 3.9's warning
    proc = subprocess.run(
        [sys.executable, "-m", "iterserve.kernels.aot", "--arch", "90", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, f"no kernel compiled (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return results


@pytest.mark.slow
def test_every_specialisation_compiles_pipelined_and_fits(compiled: list[dict[str, object]]) -> None:
    # aot.check: shared <= 227 KB, every KV loop pipelined, decode >= 3 CTAs/SM (16-bit).
    errors = {r["name"]: r["error"] for r in compiled if "error" in r}
    assert not errors, errors
    names = {str(r["name"]).split("[")[0] for r in compiled}
    assert names == {
        "paged_attention.decode",
        "paged_attention.prefill",
        "split_kv_decode",
        "split_kv_reduce",
        "rms_norm",
        "rotary",
        "silu_and_mul",
        "write_kv_cache",
    }


@pytest.mark.slow
def test_attention_loops_are_pipelined_with_loads_in_flight(compiled: list[dict[str, object]]) -> None:
    from iterserve.kernels.aot import SM90_MAX_SHARED_BYTES

    for result in compiled:
        assert 0 <= int(result["shared"]) <= SM90_MAX_SHARED_BYTES, result
        if "attention" in str(result["name"]) or "split_kv_decode" in str(result["name"]):
            # Two KV loops (whole tiles unmasked, then the masked rest), both pipelined.
            assert result["kv_loops"] == 2 and result["pipelined_loops"] == 2, result


@pytest.mark.slow
def test_every_head_dim_and_split_count_is_compiled(compiled: list[dict[str, object]]) -> None:
    from iterserve.kernels.attention_core import SUPPORTED_HEAD_DIMS
    from iterserve.kernels.split_kv import SPLIT_COUNTS

    names = [str(r["name"]) for r in compiled]
    for head_dim in SUPPORTED_HEAD_DIMS:
        assert any(n.startswith(f"paged_attention.decode[D={head_dim},") for n in names), head_dim
    for splits in SPLIT_COUNTS[1:]:
        assert any(n.startswith("split_kv_decode") and f"splits={splits}]" in n for n in names), splits
        # ... and over the eager step's work list (only non-empty splits launched).
        assert any(n.startswith("split_kv_decode") and f"splits={splits},work list]" in n for n in names)
    # The chunk launch over the eager step's heaviest-first work list, for every head layout.
    for head_dim in SUPPORTED_HEAD_DIMS:
        assert any(n.startswith(f"paged_attention.prefill[D={head_dim},") and n.endswith(",work list]")
                   for n in names), head_dim


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_compiled_to_cubin(compiled: list[dict[str, object]]) -> None:
    for result in compiled:
        assert {"ttgir", "llir", "ptx", "cubin"} <= set(result.get("stages", [])), result
        assert result["registers"] is not None and result["registers"] <= 255, result
