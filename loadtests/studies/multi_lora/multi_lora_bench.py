"""Multi-LoRA throughput on CPU: 16 adapters mixed in one batch against the base model alone.

One process, the built-in SmolLM2-135M (fp32, oneDNN linears), one engine with
`enable_lora` (max_loras 16, max_lora_rank 16) and one without, both warmed. Each arm runs
the same 32 prompts at once (batch 32: 16 prompt tokens each, 32 generated); arms alternate
round by round, each round starting one arm later.
Arms: `plain` (the engine without LoRA), `base` (the LoRA engine, no request names an
adapter: must cost nothing), `lora1`, `lora4`, `lora16` (request i uses adapter i % k).
Adapters: PEFT folders written here with seeded random A and B, rank 16, on all seven
projections (the most work an adapter can add).

`--kernels` first times the batched torch ways to apply 16 adapters to one decoder layer's
four linears at 32 decode rows (replica/lora_layers.py): a loop over the slots' runs of rows
(what ships for few adapters), one bmm over every slot's padded rows (what ships for many),
and per-row gathered A/B with bmm (not shipped).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from iterserve.replica.config import EngineConfig
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.lora_adapter import SUPPORTED_TARGETS, projection_shape
from iterserve.replica.lora_layers import LoRABatch, LoRALinear
from iterserve.replica.models.config import ModelConfig
from iterserve.replica.models.layers import Linear
from iterserve.replica.sampling_params import SamplingParams

BATCH, PROMPT_LEN, OUTPUT_LEN, RANK, NUM_ADAPTERS = 32, 16, 32, 16, 16
ARMS = {"plain": 0, "base": 0, "lora1": 1, "lora4": 4, "lora16": 16}


def write_adapter(folder: Path, cfg: ModelConfig, seed: int) -> Path:
    """A PEFT adapter folder: rank RANK on every projection, seeded random A and B."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for target in SUPPORTED_TARGETS:
            fan_in, fan_out = projection_shape(cfg, target)
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK,
         "target_modules": list(SUPPORTED_TARGETS), "bias": "none"}))
    return folder


def engine(threads: int, lora: bool) -> LLMEngine:
    extra = {"enable_lora": True, "max_loras": NUM_ADAPTERS, "max_lora_rank": RANK} if lora else {}
    return LLMEngine(EngineConfig.from_kwargs(
        dtype="float32", cpu_threads=threads, max_num_seqs=BATCH, num_gpu_blocks_override=512,
        max_num_batched_tokens=BATCH * PROMPT_LEN, **extra))


def run_arm(eng: LLMEngine, prompts: list[list[int]], adapters: list[str | None]
            ) -> tuple[float, float]:
    """Generated tokens per second of the whole batch, prefill included: per wall second, and
    per second of this process's CPU time (less sensitive to the shared box's other work,
    with one torch thread)."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    for prompt, adapter in zip(prompts, adapters, strict=True):
        eng.add_request(prompt, params, lora_name=adapter)
    generated = 0
    while eng.has_unfinished_requests():
        generated += sum(len(out.new_token_ids) for out in eng.step())
    return (generated / (time.perf_counter() - start),
            generated / (time.process_time() - cpu_start))


def time_kernels(cfg: ModelConfig, iterations: int) -> dict[str, float]:
    """Microseconds for one decoder layer's four linears on 32 decode rows: the base alone,
    then with 16 adapters each way."""
    batch = LoRABatch()
    shapes = {"qkv": [cfg.q_size, cfg.kv_size, cfg.kv_size], "o": [cfg.hidden_size],
              "gate_up": [cfg.intermediate_size] * 2, "down": [cfg.hidden_size]}
    inputs = {"qkv": cfg.hidden_size, "o": cfg.q_size, "gate_up": cfg.hidden_size,
              "down": cfg.intermediate_size}
    layers, xs = {}, {}
    for name, outs in shapes.items():
        base = Linear(inputs[name], sum(outs), False, torch.float32, "cpu")
        base.weight.data.normal_()
        offsets = [sum(outs[:i]) for i in range(len(outs))]
        lora = LoRALinear(base, list(zip(offsets, outs, strict=True)), NUM_ADAPTERS, RANK, batch)
        lora.shrink.normal_()
        lora.expand.normal_()
        layers[name], xs[name] = lora, torch.randn(BATCH, inputs[name])
    slots = [i % NUM_ADAPTERS for i in range(BATCH)]
    rows = torch.tensor(slots)
    looped, padded = LoRABatch(), LoRABatch(num_slots=NUM_ADAPTERS)
    no_adapter = LoRABatch()
    looped.assign(slots, torch.device("cpu"))
    padded.assign(slots, torch.device("cpu"))
    no_adapter.assign([-1] * BATCH, torch.device("cpu"))

    def forward(plan: LoRABatch) -> None:  # LoRALinear's forward under that plan
        batch.runs, batch.order, batch.padded = plan.runs, plan.order, plan.padded
        for name, lora in layers.items():
            lora(xs[name])

    def gathered() -> None:  # the base linear + each row's A and B gathered, then bmm
        for name, lora in layers.items():
            out = lora.base(xs[name])
            hidden = torch.bmm(lora.shrink[rows], xs[name][:, :, None])  # [T, nR, 1]
            expand = lora.expand[rows]  # [T, out, R]
            for i, (offset, size) in enumerate(lora.slices):
                out[:, offset:offset + size] += torch.bmm(
                    expand[:, offset:offset + size], hidden[:, i * RANK:(i + 1) * RANK])[..., 0]

    arms = {"base_only": lambda: forward(no_adapter), "loop_over_slots": lambda: forward(looped),
            "padded_bmm": lambda: forward(padded), "gathered_bmm": gathered}
    timings: dict[str, list[float]] = {name: [] for name in arms}
    with torch.inference_mode():
        for _ in range(3):  # alternate: the box is shared
            for name, fn in arms.items():
                fn()
                start = time.perf_counter()
                for _ in range(iterations):
                    fn()
                timings[name].append((time.perf_counter() - start) / iterations * 1e6)
    return {name: round(statistics.median(values), 1) for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every arm, alternating")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a shared box two wait on each other)")
    parser.add_argument("--kernels", action="store_true",
                        help="also time the ways to apply 16 adapters to one layer")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lora_engine, plain_engine = engine(args.threads, True), engine(args.threads, False)
    cfg = lora_engine.runner.model_config
    results: dict[str, object] = {"rounds": {arm: [] for arm in ARMS},
                                  "rounds_cpu": {arm: [] for arm in ARMS}}
    if args.kernels:
        results["kernels_us"] = time_kernels(cfg, 200)
        print("one layer, 32 rows, 16 adapters (us):", results["kernels_us"], flush=True)
    with tempfile.TemporaryDirectory() as folder:
        names = [f"adapter{i}" for i in range(NUM_ADAPTERS)]
        for i, name in enumerate(names):
            lora_engine.add_lora(name, write_adapter(Path(folder) / name, cfg, seed=i))
        rng = random.Random(0)
        prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(PROMPT_LEN)]
                   for _ in range(BATCH)]
        run_arm(plain_engine, prompts[:4], [None] * 4)  # warm both, every adapter in a slot
        print(f"warm-up done; load average {os.getloadavg()}", flush=True)
        run_arm(lora_engine, prompts[:16], names)
        arms = list(ARMS.items())
        for round_index in range(args.rounds):
            shift = round_index % len(arms)  # each round starts with the next arm: drift spreads
            for arm_index, (arm, k) in enumerate(arms[shift:] + arms[:shift]):
                eng = plain_engine if arm == "plain" else lora_engine
                adapters = [names[i % k] if k else None for i in range(BATCH)]
                # fresh prompts each round: the prefix cache must not serve a repeat
                tagged = [[1 + round_index * len(ARMS) + arm_index, *p[1:]] for p in prompts]
                tokens_s, tokens_cpu_s = run_arm(eng, tagged, adapters)
                results["rounds"][arm].append(round(tokens_s, 1))
                results["rounds_cpu"][arm].append(round(tokens_cpu_s, 1))
                print(f"round {round_index}: {arm:7s} {tokens_s:7.1f} generated tokens/s, "
                      f"{tokens_cpu_s:7.1f} per CPU second", flush=True)
    for kind in ("rounds", "rounds_cpu"):
        medians = {arm: statistics.median(values) for arm, values in results[kind].items()}
        results[f"median_{kind}"] = medians
        results[f"ratio_to_plain_{kind}"] = {arm: round(v / medians["plain"], 3)
                                             for arm, v in medians.items()}
        print(f"median tokens/s ({kind}):", medians)
        print(f"ratio to plain ({kind}):", results[f"ratio_to_plain_{kind}"])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
