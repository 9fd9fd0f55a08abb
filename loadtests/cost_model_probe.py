"""Measure the simulator's cost model on a real engine: time every step, fit `CostModel`.

    python -m iterserve.loadtests.cost_model_probe --model /models/Llama-3-8B --device cuda \\
        --out h100_llama3_8b.json
    iterserve plan --workload steady --rate 30 --gpu h100_llama3_8b.json

Runs a mixed offline workload (prompt lengths 16..4096, batches of 1..256 decodes, so
that prefill tokens, decode sequences and KV reads vary independently) through the
engine, times each `runner.execute` (its sampled token ids come back to the host, which
synchronises the GPU), records the step's (prefill_tokens, decode_seqs, kv_tokens_read)
with `SimulatedRunner.batch_shape`, and fits the four coefficients with `CostModel.fit`
(least squares). The JSON it writes is what `--gpu FILE.json` and the simulated runner's
`simulator` engine setting (`iterserve serve --simulate --simulator FILE.json`) read. Also
measure the start-up delay on the GPU (scale decision to first token) and pass it as
`ClusterSimConfig.startup_delay_s`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iterserve.replica.sim_runner import CostModel, SimulatedRunner

Sample = tuple[int, int, int, float]


def timed_runner(engine: Any, samples: list[Sample],  # noqa: ANN401
                 timer: Callable[[], float] = time.perf_counter) -> None:
    """Wrap engine.runner.execute so that every non-empty step appends a sample."""
    execute = engine.runner.execute

    def timed(scheduler_output: Any) -> Any:  # noqa: ANN401
        start = timer()
        result = execute(scheduler_output)
        if not scheduler_output.is_empty:
            samples.append((*SimulatedRunner.batch_shape(scheduler_output), timer() - start))
        return result

    engine.runner.execute = timed


def probe(engine_kwargs: dict[str, Any], rounds: int, seed: int, max_prompt: int,
          max_batch: int) -> list[Sample]:
    from iterserve.replica.llm import LLM
    from iterserve.replica.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs)
    samples: list[Sample] = []
    rng = random.Random(seed)
    llm.generate([[100] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    timed_runner(llm.engine, samples)
    for _ in range(rounds):
        batch = rng.choice([1, 4, 16, 64, max_batch])
        prompts = [[rng.randrange(16, 1000) for _ in range(rng.randint(16, max_prompt))]
                   for _ in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=rng.choice([8, 32, 128]),
                                             ignore_eos=True, temperature=0.0))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: built-in)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--rounds", type=int, default=24,
                        help="batches to run (each a random mix of prefills and decodes)")
    parser.add_argument("--max-prompt", type=int, default=4096, help="longest prompt, in tokens")
    parser.add_argument("--max-batch", type=int, default=256, help="largest batch of decodes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and batch sizes")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the fitted CostModel as JSON here (what plan --gpu reads)")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"device": args.device, "max_model_len": args.max_prompt + 256}
    if args.model:
        kwargs["model"] = args.model
    samples = probe(kwargs, args.rounds, args.seed, args.max_prompt, args.max_batch)
    cost = CostModel.fit(samples)
    fitted = {f: getattr(cost, f) for f in ("a_s", "b_s_per_prefill_token",
                                            "c_s_per_decode_seq", "d_s_per_kv_token")}
    text = json.dumps({"steps": len(samples), **fitted}, indent=1)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(fitted, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
