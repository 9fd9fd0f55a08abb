"""GPU first light: the step probe. Timed engine steps of a random-weight Llama-3-8B-shaped
model (load_format="dummy") over a grid of batch shapes; `CostModel.fit` turns them into
cost_model.json for the cluster simulator and the simulated runner (the engine setting
`simulator`: `iterserve serve --simulate --simulator cost_model.json`).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from iterserve.replica.sim_runner import CostModel, SimulatedRunner

# Llama-3-8B's shape (no weights: load_format="dummy"); the tokenizer is the committed one.
LLAMA_3_8B = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
    "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 8192,
}  # fmt: skip


class StepTimer:
    """Wraps the engine's runner: times every execute (device synced) with its batch shape."""

    def __init__(self, runner: Any, sync: Callable[[], None]) -> None:
        self.runner, self.sync = runner, sync
        self.samples: list[tuple[int, int, int, float]] = []

    def execute(self, scheduler_output: Any) -> Any:
        self.sync()
        start = time.perf_counter()
        result = self.runner.execute(scheduler_output)
        self.sync()
        shape = SimulatedRunner.batch_shape(scheduler_output)
        self.samples.append((*shape, time.perf_counter() - start))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def probe_steps(folder: Path, device: str, batches: tuple[int, ...], prompt_lens: tuple[int, ...],
                decode_steps: int, startup: dict[str, Any]) -> list[tuple[int, int, int, float]]:  # fmt: skip
    """Timed steps of batches of prompts, prefill chunks and decodes, on dummy weights; the
    engine's start-up phases go into `startup`."""
    from iterserve.replica.config import EngineConfig
    from iterserve.replica.llm_engine import LLMEngine
    from iterserve.replica.sampling_params import SamplingParams

    config = EngineConfig.from_kwargs(
        model=str(folder), load_format="dummy", dtype="bfloat16", device=device,
        max_num_seqs=max(batches), max_num_batched_tokens=4096,
        max_model_len=max(prompt_lens) + decode_steps + 16,
        enable_prefix_caching=False, gpu_memory_utilization=0.8,
    )  # fmt: skip
    started = time.perf_counter()
    engine = LLMEngine(config)
    startup["step probe model, bf16 (dummy weights)"] = {
        "ready_s": time.perf_counter() - started, **engine.runner.startup_s}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    timer = StepTimer(engine.runner, sync)
    engine.runner = timer
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True)
    for batch in batches:
        for prompt_len in prompt_lens:
            for _ in range(batch):
                engine.add_request(torch.randint(10, 4000, (prompt_len,), generator=gen).tolist(), params)
            while engine.has_unfinished_requests():
                engine.step()
    return timer.samples[1:]  # the first step pays one-off warm-up (JIT, allocator)


def stage_step_probe(out: Path, device: str, shape: dict[str, Any], batches: tuple[int, ...],
                     prompt_lens: tuple[int, ...], decode_steps: int,
                     startup: dict[str, Any]) -> list[list[str]]:  # fmt: skip
    from iterserve.replica.make_model import write_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "probe-model", arch="llama", overrides=shape,
                             with_weights=False)  # fmt: skip
        samples = probe_steps(folder, device, batches, prompt_lens, decode_steps, startup)
    cost = CostModel.fit(samples)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    coefficients = {field: getattr(cost, field) for field in CostModel.__dataclass_fields__}
    (out / "cost_model.json").write_text(json.dumps(coefficients, indent=2) + "\n")
    (out / "step_samples.json").write_text(json.dumps({"device": name, "model": shape,
                                                       "samples": samples}) + "\n")  # fmt: skip
    fitted = ", ".join(f"{k}={v:.3g}" for k, v in coefficients.items())
    return [["step probe", f"{len(samples)} steps on {name}, CostModel.fit -> cost_model.json",
             fitted, "ok"]]  # fmt: skip
