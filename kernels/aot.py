"""Compile every kernel for a GPU target without a GPU: `python -m iterserve.kernels.aot`.

The interpreter does not enforce tl.dot shape rules, shared-memory or register limits, so a
kernel can pass every CPU test and still fail to compile for Hopper. This module compiles each
kernel, in the configurations its launcher picks, with triton.compile(ASTSource, GPUTarget)
all the way to a cubin (the triton wheel ships ptxas) and reports the shared memory each one
needs. It must run without TRITON_INTERPRET: under the interpreter @triton.jit returns an
InterpretedFunction, which cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from iterserve.kernels._common import elementwise_num_warps, is_interpreting, next_power_of_2
from iterserve.kernels.activation import silu_and_mul_kernel
from iterserve.kernels.kv_cache import write_kv_cache_kernel
from iterserve.kernels.norm import rms_norm_kernel
from iterserve.kernels.paged_attention import attention_config, paged_attention_kernel
from iterserve.kernels.rotary import rotary_embedding_kernel
from iterserve.kernels.split_kv import (
    DECODE_TILE_N,
    MAX_SPLITS,
    split_kv_decode_kernel,
    split_kv_reduce_kernel,
)

# Max shared memory one block can use on H100/H200 (sm_90): 227 KB of the SM's 228 KB.
SM90_MAX_SHARED_BYTES = 227 * 1024
# NVIDIA warps are 32 threads; GPUTarget's third field is the warp size.
WARP_SIZE = 32


@dataclass
class KernelSpec:
    """One kernel in one launch configuration, described for triton.compile."""

    name: str
    kernel: object  # a triton JITFunction
    signature: dict[str, str]  # arg name -> triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3
    # Args the real launch would see as 16-divisible (aligned pointers, strides, sizes).
    aligned: list[str] = field(default_factory=list)


def _sig(kernel: object, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    names = kernel.arg_names  # type: ignore[attr-defined]
    sig = {}
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:
            raise ValueError(f"{kernel}: no type given for argument {name}")
    return sig


def _spec(
    name: str,
    kernel: object,
    types: dict[str, str],
    constexprs: dict[str, object],
    num_warps: int = 4,
    num_stages: int = 3,
) -> KernelSpec:
    aligned = [n for n, t in types.items() if t.startswith("*") or n.startswith("stride")]
    return KernelSpec(
        name,
        kernel,
        _sig(kernel, types, constexprs),
        constexprs,
        num_warps,
        num_stages,
        aligned,
    )


# (head_dim, group, tokens, seqs): the batch shapes attention_config maps to tile configs.
SERVING_SHAPES = [
    (128, 4, 64, 64),  # pure decode, Llama-3-8B heads
    (128, 4, 512, 32),  # mixed batch
    (128, 4, 4096, 1),  # long prefill chunk
    (128, 8, 4096, 1),
    (64, 1, 64, 64),
    (64, 8, 4096, 1),
    (256, 2, 4096, 1),  # Gemma-style head dim
]
# Every spec uses the num_warps / num_stages its launcher passes (triton's default stages: 3).
# Other dtypes: one shape per tile config is enough (fp32 dots compile slowly: no MMA).
SPOT_SHAPES = [(128, 4, 64, 64), (128, 4, 512, 32), (64, 8, 4096, 1)]


def _attention_specs(
    dtype: str, tl_dtype: tl.dtype, index: str, shapes: list[tuple[int, int, int, int]]
) -> list[KernelSpec]:
    specs = []
    for head_dim, group, tokens, seqs in shapes:
        cfg = attention_config(tokens, seqs, group, head_dim)
        types = {
            "out_ptr": f"*{dtype}",
            "query_ptr": f"*{dtype}",
            "k_cache_ptr": f"*{dtype}",
            "v_cache_ptr": f"*{dtype}",
            "query_start_loc_ptr": f"*{index}",
            "seq_lens_ptr": f"*{index}",
            "block_tables_ptr": f"*{index}",
            "scale_log2": "fp32",
            "num_seqs": "i32",
            "head_dim": "i32",
        }
        types |= {n: "i32" for n in paged_attention_kernel.arg_names if n.startswith("stride")}
        constexprs = {
            "GROUP": group,
            "BLOCK_Q": cfg["BLOCK_Q"],
            "BLOCK_M": cfg["BLOCK_M"],
            "BLOCK_D": next_power_of_2(head_dim),
            "TILE_N": cfg["TILE_N"],
            "BLOCK_SIZE": 16,
            "DOT_DTYPE": tl_dtype,
        }
        specs.append(
            _spec(
                f"paged_attention[D={head_dim},G={group},BLOCK_M={cfg['BLOCK_M']},{dtype},{index}]",
                paged_attention_kernel,
                types,
                constexprs,
                cfg["num_warps"],
                cfg["num_stages"],
            )
        )
    for head_dim, group in sorted({(d, g) for d, g, _, _ in shapes if d <= 128}):
        types = {
            "partial_out_ptr": "*fp32",
            "partial_lse_ptr": "*fp32",
            "query_ptr": f"*{dtype}",
            "k_cache_ptr": f"*{dtype}",
            "v_cache_ptr": f"*{dtype}",
            "seq_lens_ptr": f"*{index}",
            "block_tables_ptr": f"*{index}",
            "scale_log2": "fp32",
            "head_dim": "i32",
        }
        types |= {n: "i32" for n in split_kv_decode_kernel.arg_names if n.startswith("stride")}
        constexprs = {
            "GROUP": group,
            "BLOCK_M": max(16, next_power_of_2(group)),
            "BLOCK_D": next_power_of_2(head_dim),
            "TILE_N": DECODE_TILE_N,
            "BLOCK_SIZE": 16,
            "NUM_SPLITS": 16,
            "DOT_DTYPE": tl_dtype,
        }
        specs.append(
            _spec(
                f"split_kv_decode[D={head_dim},G={group},{dtype},{index}]",
                split_kv_decode_kernel,
                types,
                constexprs,
            )
        )
    types = {
        "out_ptr": f"*{dtype}",
        "partial_out_ptr": "*fp32",
        "partial_lse_ptr": "*fp32",
        "seq_lens_ptr": f"*{index}",
        "head_dim": "i32",
        "stride_o_s": "i32",
        "stride_o_h": "i32",
    }
    constexprs = {
        "NUM_SPLITS": MAX_SPLITS,
        "SPLITS_PAD": MAX_SPLITS,
        "BLOCK_D": 128,
        "TILE_N": DECODE_TILE_N,
    }
    specs.append(_spec(f"split_kv_reduce[{dtype},{index}]", split_kv_reduce_kernel, types, constexprs, 4, 3))
    return specs


def _small_specs(dtype: str) -> list[KernelSpec]:
    specs = []
    for hidden, add in [(4096, True), (8192, False), (16384, True)]:
        block = next_power_of_2(hidden)
        types = {
            "x_ptr": f"*{dtype}",
            "residual_ptr": f"*{dtype}",
            "weight_ptr": f"*{dtype}",
            "out_ptr": f"*{dtype}",
            "residual_out_ptr": f"*{dtype}",
            "stride_x": "i32",
            "stride_residual": "i32",
            "hidden": "i32",
            "eps": "fp32",
        }
        specs.append(
            _spec(
                f"rms_norm[H={hidden},add={add},{dtype}]",
                rms_norm_kernel,
                types,
                {"ADD_RESIDUAL": add, "BLOCK": block},
                elementwise_num_warps(block),
                3,
            )
        )
    types = {
        "positions_ptr": "*i64",
        "query_ptr": f"*{dtype}",
        "key_ptr": f"*{dtype}",
        "cos_sin_ptr": "*fp32",
    }
    types |= {n: "i32" for n in rotary_embedding_kernel.arg_names if n.startswith("stride")}
    types |= {"num_heads": "i32", "num_kv_heads": "i32", "half": "i32"}
    specs.append(
        _spec(
            f"rotary[D=128,{dtype}]", rotary_embedding_kernel, types, {"BLOCK_H": 32, "BLOCK_HALF": 64}, 4, 3
        )
    )
    specs.append(
        _spec(
            f"silu_and_mul[{dtype}]",
            silu_and_mul_kernel,
            {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "stride_x": "i32", "inter": "i32"},
            {"BLOCK": 1024},
            4,
            3,
        )
    )
    types = {
        "key_ptr": f"*{dtype}",
        "value_ptr": f"*{dtype}",
        "k_cache_ptr": f"*{dtype}",
        "v_cache_ptr": f"*{dtype}",
        "slot_mapping_ptr": "*i64",
        "num_kv_heads": "i32",
        "head_dim": "i32",
    }
    types |= {n: "i32" for n in write_kv_cache_kernel.arg_names if n.startswith("stride")}
    specs.append(
        _spec(
            f"write_kv_cache[{dtype}]",
            write_kv_cache_kernel,
            types,
            {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128},
            4,
            3,
        )
    )
    return specs


def all_specs() -> list[KernelSpec]:
    # bf16 is the serving dtype; fp16 with int64 metadata and fp32 (ieee dots, the GPU test
    # path) cover the other dtypes and index widths the launchers accept.
    return (
        _attention_specs("bf16", tl.bfloat16, "i32", SERVING_SHAPES)
        + _attention_specs("fp16", tl.float16, "i64", SPOT_SHAPES)
        + _attention_specs("fp32", tl.float32, "i32", SPOT_SHAPES)
        + _small_specs("bf16")
    )


def compile_spec(spec: KernelSpec, arch: int) -> dict[str, object]:
    """Compile one spec for cuda:arch; returns name, stages produced, shared bytes, seconds."""
    names = list(spec.signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.aligned}
    src = ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    start = time.perf_counter()
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", arch, WARP_SIZE),
        options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
    )
    return {
        "name": spec.name,
        "stages": sorted(compiled.asm.keys()),
        "shared": int(compiled.metadata.shared),
        "num_warps": spec.num_warps,
        "num_stages": spec.num_stages,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    parser.add_argument("--json", action="store_true", help="print one JSON object per kernel")
    args = parser.parse_args(argv)
    if is_interpreting():
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    failures = 0
    for spec in all_specs():
        try:
            result = compile_spec(spec, args.arch)
        except Exception as exc:  # report every kernel's failure, then fail at the end
            failures += 1
            result = {"name": spec.name, "error": f"{type(exc).__name__}: {exc}"}
        else:
            if result["shared"] > SM90_MAX_SHARED_BYTES:
                failures += 1
                result["error"] = f"needs {result['shared']} B shared > {SM90_MAX_SHARED_BYTES}"
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            status = result.get("error") or f"ok shared={result['shared']} B {result['seconds']}s"
            print(f"{spec.name:55s} {status}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
