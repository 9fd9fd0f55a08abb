"""Structured-output figures: schema validity, decode overhead, compile time and cache hits.

    python -m iterserve.loadtests.studies.structured_outputs.structured_bench validity [--model M] \
        [--count 50]
    python -m iterserve.loadtests.studies.structured_outputs.structured_bench overhead [--model M] \
        [--batch 64]

validity: `count` seeded requests, each with its own schema from
  loadtests/structured_workload.assorted_schemas, temperature 0.8, max_tokens 256; reports
  how many return JSON that validates (jsonschema) and the finish reasons.
overhead: a batch of `batch` requests all constrained by the moderately complex schema vs the
  same batch free, run A B A B in one process, equal max_tokens (the free ones ignore EOS);
  reports output tokens/s of each and the ratio, then compile time p50/p99 over distinct
  schemas compiled cold, and the compile cache hit rate of the whole run.
The model defaults to the built-in one (None); `--model iterserve-tiny` is the tiny model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import Counter

from iterserve.loadtests.studies.structured_outputs.structured_workload import (
    assorted_schemas,
    moderately_complex_schema,
)
from iterserve.replica import LLM, SamplingParams
from iterserve.replica.structured_spec import StructuredSpec

PROMPT = "Reply with a JSON object that fits the requested schema."


def chat_prompt_ids(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.engine.tokenizer
    if tokenizer.chat_template is None:
        return tokenizer.encode(text)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)


def validity(llm: LLM, count: int, seed: int) -> dict:
    import jsonschema

    schemas = assorted_schemas(seed, count)
    params = [SamplingParams(temperature=0.8, seed=seed + i, max_tokens=256,
                             structured=StructuredSpec.from_json_schema(s))
              for i, s in enumerate(schemas)]
    prompts = [chat_prompt_ids(llm, f"{PROMPT}\nSchema: {json.dumps(s)}") for s in schemas]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    valid, reasons, failures = 0, Counter(), []
    for schema, result in zip(schemas, results, strict=True):
        out = result.outputs[0]
        reasons[out.finish_reason] += 1
        try:
            jsonschema.validate(json.loads(out.text), schema)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as error:
            failures.append((out.finish_reason, out.text[:120], type(error).__name__))
    return {"requests": count, "valid": valid, "finish_reasons": dict(reasons),
            "seconds": round(elapsed, 1), "failures": failures[:5],
            "example": results[0].outputs[0].text}


def _tokens_per_s(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return tokens / elapsed, tokens


def overhead(llm: LLM, batch: int, max_tokens: int, rounds: int) -> dict:
    schema = moderately_complex_schema()
    prompts = [chat_prompt_ids(llm, f"{PROMPT} Order number {i}.") for i in range(batch)]
    free = SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens,
                                 structured=StructuredSpec.from_json_schema(schema))
    # Warm-up of both sides at the measured batch shape (imports, the grammar's compile,
    # kernels built on first use): left in, they would land on whichever side runs first.
    for params in (free, constrained):
        _tokens_per_s(llm, prompts, dataclasses.replace(params, max_tokens=2))
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    tokens: dict[str, int] = {}
    for _ in range(rounds):  # A B A B: the shared box drifts, so interleave
        for name, params in (("free", free), ("constrained", constrained)):
            rate, count = _tokens_per_s(llm, prompts, params)
            runs[name].append(rate)
            tokens[name] = count
    free_rate = statistics.mean(runs["free"])
    constrained_rate = statistics.mean(runs["constrained"])
    return {"batch": batch, "max_tokens": max_tokens, "rounds": rounds,
            "free_tok_s": [round(r, 1) for r in runs["free"]],
            "constrained_tok_s": [round(r, 1) for r in runs["constrained"]],
            "tokens_per_run": tokens,
            "ratio_constrained_over_free": round(constrained_rate / free_rate, 3)}


def compile_times(llm: LLM, count: int) -> dict:
    """Cold compiles of distinct schemas on the engine's pool (the cache then serves them)."""
    pool = llm.engine.constrained.pool
    specs = [StructuredSpec.from_json_schema(s) for s in assorted_schemas(1000, count)]
    specs.append(StructuredSpec.from_json_schema(moderately_complex_schema()))
    before = len(pool.stats().compile_times_s)
    for spec in specs:
        pool.cache.pop(spec, None)
        pool.compile(spec).result()
    times = sorted(pool.stats().compile_times_s[before:])
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return {"schemas": len(times), "p50_ms": round(1000 * statistics.median(times), 2),
            "p99_ms": round(1000 * p99, 2), "max_ms": round(1000 * times[-1], 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("validity", "overhead"),
                        help="validity: schema validity of seeded requests; overhead: constrained vs "
                             "free decode")
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--count", type=int, default=50,
                        help="validity: requests, each with its own schema")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schemas")
    parser.add_argument("--batch", type=int, default=64, help="overhead: requests in one batch")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="overhead: tokens each request generates")
    parser.add_argument("--rounds", type=int, default=2, help="overhead: A B rounds (constrained, free)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="the engine's context length")
    args = parser.parse_args(argv)
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 64))
    report: dict = {"model": llm.engine.model_name}
    if args.mode == "validity":
        report.update(validity(llm, args.count, args.seed))
    else:
        hits_before = llm.engine.constrained.pool.stats()
        report.update(overhead(llm, args.batch, args.max_tokens, args.rounds))
        stats = llm.engine.constrained.pool.stats()
        requests = stats.num_requests - hits_before.num_requests
        hits = stats.num_cache_hits - hits_before.num_cache_hits
        report["cache_hit_rate"] = round(hits / requests, 3) if requests else None
        report["compile"] = compile_times(llm, 100)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
