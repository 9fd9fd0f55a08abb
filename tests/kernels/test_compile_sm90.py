"""Every kernel compiles for sm_90 (H100/H200) without a GPU and fits in shared memory.

The interpreter checks none of tl.dot's shape rules, layouts or shared-memory limits, so this
compiles each kernel, in the configurations its launcher picks, down to a cubin with the
ptxas that ships in the triton wheel. It runs in a subprocess without TRITON_INTERPRET
(which this directory's conftest sets, and under which kernels cannot be compiled).
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
        timeout=300,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, f"no kernel compiled (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return results


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(compiled: list[dict[str, object]]) -> None:
    errors = {r["name"]: r["error"] for r in compiled if "error" in r}
    assert not errors, errors
    names = {str(r["name"]).split("[")[0] for r in compiled}
    assert names == {
        "paged_attention",
        "split_kv_decode",
        "split_kv_reduce",
        "rms_norm",
        "rotary",
        "silu_and_mul",
        "write_kv_cache",
    }


@pytest.mark.slow
def test_shared_memory_fits_hopper(compiled: list[dict[str, object]]) -> None:
    from iterserve.kernels.aot import SM90_MAX_SHARED_BYTES

    for result in compiled:
        assert 0 <= int(result.get("shared", 0)) <= SM90_MAX_SHARED_BYTES, result


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_compiled_to_cubin(compiled: list[dict[str, object]]) -> None:
    for result in compiled:
        assert {"ttgir", "llir", "ptx", "cubin"} <= set(result.get("stages", [])), result
