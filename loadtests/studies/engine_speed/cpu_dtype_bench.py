"""fp32 vs bf16 matmuls at SmolLM2-135M's shapes on this CPU (what the CPU dtype default rests on).

    python -m iterserve.loadtests.studies.engine_speed.cpu_dtype_bench            # matmul speed
    python -m iterserve.loadtests.studies.engine_speed.cpu_dtype_bench --scores   # what bf16 does \
        to the answers

Speed: times `F.linear` over the qkv, o, gate+up, down and lm_head shapes for a decode batch
(32 rows) and a prefill chunk (512 rows), on one and two threads, fp32 and bf16 alternating;
min of 5 x 10 repeats.
Scores: the built-in model's prompt log-probabilities and greedy tokens on four texts, engine
in fp32 and in bf16: what an evaluation client (lm-eval's log-likelihoods) would see change.
"""

from __future__ import annotations

import argparse
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


SCORED_TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on mountains.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon during Apollo 11.",
]
GREEDY_TOKENS = 24


def scores(dtype: str) -> list[tuple[list[float], list[int]]]:
    """(prompt token log-probabilities, greedy output ids) per text, engine in `dtype`."""
    from iterserve.replica.llm import LLM
    from iterserve.replica.sampling_params import SamplingParams

    llm = LLM(dtype=dtype, cpu_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, prompt_logprobs=0)
    return [([entry.logprob for entry in out.prompt_logprobs[1:]], out.outputs[0].token_ids)
            for out in llm.generate(SCORED_TEXTS, params)]


def print_score_drift() -> None:
    full, half = scores("float32"), scores("bfloat16")
    token_diffs, text_diffs, same_prefix = [], [], []
    for (lp32, ids32), (lp16, ids16) in zip(full, half, strict=True):
        token_diffs += [abs(a - b) for a, b in zip(lp32, lp16, strict=True)]
        text_diffs.append(abs(sum(lp32) - sum(lp16)))
        same_prefix.append(next((i for i, (a, b) in enumerate(zip(ids32, ids16, strict=True))
                                 if a != b), len(ids32)))
    print(f"bf16 vs fp32 prompt logprobs: per token |diff| max {max(token_diffs):.4f}, mean "
          f"{sum(token_diffs) / len(token_diffs):.4f}; per text |sum diff| "
          f"{[round(d, 3) for d in text_diffs]}; greedy tokens equal before the first "
          f"divergence: {same_prefix} of {GREEDY_TOKENS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scores", action="store_true",
                        help="compare bf16 and fp32 answers instead of timing matmuls")
    if parser.parse_args().scores:
        print_score_drift()
        return
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
