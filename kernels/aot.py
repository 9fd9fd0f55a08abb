"""Compile the kernels for a GPU without one: `python -m iterserve.kernels.aot [--markdown]`.

The interpreter enforces none of tl.dot's shape rules, layouts, shared-memory or register
limits, and says nothing of software pipelining, so this compiles every specialisation the
engine can launch down to a cubin (the triton wheel ships ptxas) and reports, per kernel:
registers per thread (cuobjdump), shared memory, resident CTAs per SM, and whether each KV
loop (a loop with a tl.dot) is pipelined: a `ttg.async_wait` with num > 0 inside the loop
means the next tiles' loads are still in flight while this tile computes.

The specialisations are exactly the runtime's: each comes from the launcher's own Launch
(launch.py), built from host tensors of the shapes the engine uses, and goes through
triton's own argument binder for the target backend, so pointers and ints get the same
16-divisibility marks (and ints equal to 1 the same constexpr) the JIT would give them.
It must run without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from iterserve.kernels._common import is_interpreting
from iterserve.kernels.aot_shapes import all_launches
from iterserve.kernels.launch import Launch

# Max shared memory one block can use on H100/H200 (sm_90): 227 KB of the SM's 228 KB.
SM90_MAX_SHARED_BYTES = 227 * 1024
SM90_SHARED_PER_SM = 228 * 1024
SM90_RESERVED_SHARED_PER_CTA = 1024  # the driver reserves 1 KB per resident block
SM90_REGISTERS_PER_SM = 65536
SM90_MAX_WARPS_PER_SM = 64
SM90_MAX_CTAS_PER_SM = 32
WARP_SIZE = 32  # GPUTarget's third field
# Decode is memory-bound: enough resident CTAs per SM to keep loads in flight.
MIN_DECODE_CTAS_PER_SM = 3
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def bind(launch: Launch, target: GPUTarget) -> tuple[ASTSource, dict[str, Any]]:
    """The (source, options) triton's JIT would compile for this launch on `target`."""
    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {"num_warps": launch.num_warps, "num_stages": launch.num_stages, "debug": False}
    bound, specialization, options = binder(*launch.args, **launch.constexprs, **kwargs)
    # The same packing JITFunction.run does before it compiles (triton 3.9).
    opts, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), opts.__dict__


def kv_loops(ttgir: str) -> list[str]:
    """The text of each outermost scf.for in the TTGIR that contains a dot."""
    lines = ttgir.splitlines()
    loops, i = [], 0
    while i < len(lines):
        if "scf.for" in lines[i]:
            depth, j = 0, i
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                if depth <= 0 and j > i:
                    break
                j += 1
            body = "\n".join(lines[i : j + 1])
            if "tt.dot" in body or "warp_group_dot" in body:
                loops.append(body)
            i = j + 1
        else:
            i += 1
    return loops


def is_pipelined(loop: str) -> bool:
    return any(int(n) > 0 for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", loop))


def registers(cubin: bytes) -> int | None:
    if not CUOBJDUMP.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", text)
    return int(found.group(1)) if found else None


def ctas_per_sm(regs: int | None, shared: int, num_warps: int) -> int:
    """Resident CTAs per SM from registers (allocated per warp in 256s), shared memory, warps."""
    by_warps = SM90_MAX_WARPS_PER_SM // num_warps
    by_regs = by_warps
    if regs:
        per_warp = -(-regs * WARP_SIZE // 256) * 256
        by_regs = SM90_REGISTERS_PER_SM // (per_warp * num_warps)
    by_shared = SM90_SHARED_PER_SM // (shared + SM90_RESERVED_SHARED_PER_CTA)
    return min(by_warps, by_regs, by_shared, SM90_MAX_CTAS_PER_SM)


def compile_launch(name: str, launch: Launch, arch: int) -> dict[str, object]:
    target = GPUTarget("cuda", arch, WARP_SIZE)
    src, options = bind(launch, target)
    start = time.perf_counter()
    compiled = triton.compile(src, target=target, options=options)
    shared = int(compiled.metadata.shared)
    regs = registers(compiled.asm["cubin"]) if "cubin" in compiled.asm else None
    loops = kv_loops(compiled.asm["ttgir"])
    return {
        "name": name,
        "stages": sorted(compiled.asm.keys()),
        "registers": regs,
        "shared": shared,
        "num_warps": launch.num_warps,
        "num_stages": launch.num_stages,
        "ctas_per_sm": ctas_per_sm(regs, shared, launch.num_warps),
        "kv_loops": len(loops),
        "pipelined_loops": sum(is_pipelined(loop) for loop in loops),
        "seconds": round(time.perf_counter() - start, 2),
    }


def check(result: dict[str, object]) -> str | None:
    """Why a compiled specialisation is not fit to ship, or None."""
    if int(result["shared"]) > SM90_MAX_SHARED_BYTES:
        return f"needs {result['shared']} B shared > {SM90_MAX_SHARED_BYTES}"
    if result["pipelined_loops"] != result["kv_loops"]:
        return f"{result['kv_loops'] - result['pipelined_loops']} KV loop(s) not pipelined"
    name = str(result["name"])
    # fp32 caches are the test path (exact ieee dots), not a serving dtype: no occupancy goal.
    is_decode = name.startswith(("paged_attention.decode", "split_kv_decode"))
    if is_decode and "fp32" not in name and int(result["ctas_per_sm"]) < MIN_DECODE_CTAS_PER_SM:
        return f"decode runs {result['ctas_per_sm']} CTAs/SM < {MIN_DECODE_CTAS_PER_SM}"
    return None


def markdown(results: list[dict[str, object]]) -> str:
    head = (
        "| kernel specialisation | warps | stages | registers | shared KB | CTAs/SM | KV loops pipelined |\n"
        "|---|---:|---:|---:|---:|---:|---|\n"
    )
    rows = []
    for r in results:
        if "error" in r and "shared" not in r:
            rows.append(f"| {r['name']} | | | | | | FAILED: {r['error']} |")
            continue
        loops = f"{r['pipelined_loops']}/{r['kv_loops']}" if r["kv_loops"] else "no KV loop"
        rows.append(
            f"| {r['name']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
            f"{int(r['shared']) / 1024:.1f} | {r['ctas_per_sm']} | {loops} |"
        )
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    parser.add_argument("--json", action="store_true", help="print one JSON object per kernel")
    parser.add_argument("--markdown", action="store_true", help="print one markdown table at the end")
    parser.add_argument("--only", default="", help="compile only names containing this")
    args = parser.parse_args(argv)
    if is_interpreting():
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    failures, results = 0, []
    for name, launch in all_launches():
        if args.only not in name:
            continue
        try:
            result = compile_launch(name, launch, args.arch)
        except Exception as exc:  # report every kernel's failure, then fail at the end
            result = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
        else:
            problem = check(result)
            if problem:
                result["error"] = problem
        failures += "error" in result
        results.append(result)
        if args.json:
            print(json.dumps(result), flush=True)
        elif not args.markdown:
            status = result.get("error") or (
                f"ok regs={result['registers']} shared={result['shared']} B "
                f"ctas/sm={result['ctas_per_sm']} pipelined={result['pipelined_loops']}/{result['kv_loops']}"
            )
            print(f"{name:70s} {status}", flush=True)
    if args.markdown:
        print(markdown(results), end="")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
