"""How an engine step's time grows with batch size, offline (no HTTP, no Ray).

    python -m iterserve.loadtests.studies.engine_speed.engine_step_probe --batch-sizes 1,16,64 --max-tokens 64

Continuous batching beats static batching on tokens/s only where a step costs about the same
whatever the batch size (a GPU's memory-bound decode): then static's draining batches waste
steps. Where step time grows in proportion to the batch (a CPU running a tiny model), a half
empty static batch just runs faster steps, and the two modes deliver similar tokens/s; the
difference shows in TTFT (queueing) instead. This probe tells which regime a machine is in.
"""

from __future__ import annotations

import argparse
import sys
import time

from iterserve.autoscale.sim.workload import LengthBucket, OutputLengths, make_workload


def probe(batch_sizes: list[int], max_tokens: int, prompt_len: int,
          engine_kwargs: dict[str, str]) -> list[tuple[int, float, float]]:
    """(batch size, ms per decode step, output tokens/s) for each batch size."""
    from iterserve.replica.llm import LLM
    from iterserve.replica.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    llm.generate([[100] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    rows = []
    for batch in batch_sizes:
        requests = make_workload(batch, seed=batch, output_lengths=OutputLengths.fixed(max_tokens),
                                 prompt_buckets=(LengthBucket("fixed", prompt_len, prompt_len,
                                                              1.0),))
        start = time.perf_counter()
        llm.generate([r.prompt_token_ids for r in requests], params)
        elapsed = time.perf_counter() - start
        rows.append((batch, elapsed / max_tokens * 1000.0, batch * max_tokens / elapsed))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64",
                        help="comma-separated batch sizes to time a step at")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each request")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    print("batch  ms/step  output tok/s")
    for batch, step_ms, rate in probe(sizes, args.max_tokens, args.prompt_len,
                                      {"device": args.device}):
        print(f"{batch:5d}  {step_ms:7.1f}  {rate:12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
