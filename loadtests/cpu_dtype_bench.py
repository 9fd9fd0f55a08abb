"""fp32 vs bf16 matmuls at SmolLM2-135M's shapes on this CPU (what the CPU dtype default rests on).

    python -m iterserve.loadtests.cpu_dtype_bench

Times `F.linear` over the qkv, o, gate+up, down and lm_head shapes for a decode batch (32 rows)
and a prefill chunk (512 rows), on one and two threads, fp32 and bf16 alternating; min of
5 x 10 repeats.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

HIDDEN = 576
OUT_IN = [(576 + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * 1536, HIDDEN), (HIDDEN, 1536),
          (49152, HIDDEN)]  # (out, in) of qkv, o, gate+up, down, lm_head


def layer_matmuls(rows: int, dtype: torch.dtype) -> Callable[[], None]:
    weights = [torch.randn(out, inp, dtype=dtype) for out, inp in OUT_IN]
    inputs = [torch.randn(rows, inp, dtype=dtype) for _, inp in OUT_IN]

    def run() -> None:
        for x, w in zip(inputs, weights, strict=True):
            torch.nn.functional.linear(x, w)

    return run


def main() -> None:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (32, 512):
            runs = {dtype: layer_matmuls(rows, dtype) for dtype in (torch.float32, torch.bfloat16)}
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(5):
                for dtype, run in runs.items():
                    run()
                    start = time.perf_counter()
                    for _ in range(10):
                        run()
                    best[dtype] = min(best[dtype], (time.perf_counter() - start) / 10)
            fp32, bf16 = best[torch.float32], best[torch.bfloat16]
            print(f"threads {threads} rows {rows}: fp32 {fp32 * 1e3:.2f} ms, "
                  f"bf16 {bf16 * 1e3:.2f} ms, bf16/fp32 time {bf16 / fp32:.2f}", flush=True)


if __name__ == "__main__":
    main()
