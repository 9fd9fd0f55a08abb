"""The engine's decode step on a GPU: a Llama-3.2-1B-shaped random bf16 model.

    python -m iterserve.loadtests.studies.gpu_first_light.engine_decode_bench [--out FILE]   (also \
        run by kernel_bench)

For batch 1, 16, 64 and 256 at a fixed context, it times the runner's step (input copy,
forward, sampling) and the whole engine step (plus scheduling and detokenization), with CUDA
graphs and eagerly, against the byte floor: weights plus the batch's KV read once, divided by
the measured device-to-device copy bandwidth. Floor: the runner step with CUDA graphs within
1.2x of it. Rows are kernel_bench's (section, case, measured, floor, verdict).
With graphs, the engine step is also timed with async scheduling on (the CPU plans step N+1
while the GPU runs step N): floor, within 1.05x of the runner step.

A `DecodeBench` sets the shape, batches and device: the GPU first light's dry run runs the
same code on CPU with a small model (no graphs there, floors not judged).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from iterserve.replica.config import EngineConfig
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.make_model import write_model
from iterserve.replica.sampling_params import SamplingParams

# Llama 3.2 1B's shape (its tokenizer is not shipped: token ids are random, vocab kept).
LLAMA_32_1B = {
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
    "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}
BATCHES = (1, 16, 64, 256)
CONTEXT = 1024
TIMED_STEPS = 20


@dataclass(frozen=True)
class DecodeBench:
    """What the decode-step benchmark runs: the GPU's by default."""

    model: dict[str, Any] = field(default_factory=lambda: dict(LLAMA_32_1B))
    batches: tuple[int, ...] = BATCHES
    context: int = CONTEXT
    timed_steps: int = TIMED_STEPS
    device: str = "cuda"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str = "cuda") -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy."""
    src = torch.empty(1 << 30 if device == "cuda" else 1 << 26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def make_engine(folder: Path, eager: bool, async_scheduling: bool = False,
                bench: DecodeBench = DecodeBench()) -> LLMEngine:  # fmt: skip
    config = EngineConfig.from_kwargs(
        model=str(folder), load_format="dummy", dtype="bfloat16", device=bench.device,
        enforce_eager=eager, async_scheduling=async_scheduling,
        max_num_seqs=max(bench.batches), max_num_batched_tokens=8192,
        max_model_len=bench.context + 256, enable_prefix_caching=False, gpu_memory_utilization=0.45,
    )
    return LLMEngine(config)


def time_decode(engine: LLMEngine, batch: int, bench: DecodeBench = DecodeBench()) -> tuple[float, float]:
    """Median ms of (runner step, engine step) with `batch` requests decoding at the context."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    ids = [engine.add_request(torch.randint(10, 4000, (bench.context,), generator=gen).tolist(), params)
           for _ in range(batch)]
    while not engine.scheduler.all_running_have_output() or engine.scheduler.num_waiting:
        engine.step()
    engine.finish_in_flight()  # async scheduling: settle before stepping the parts by hand
    scheduler, runner = engine.scheduler, engine.runner
    runner_ms, engine_ms = [], []
    for _ in range(bench.timed_steps):
        output = scheduler.schedule()
        _sync(bench.device)
        start = time.perf_counter()
        result = runner.execute(output)  # sampling ends in .tolist(): the GPU work is done
        runner_ms.append((time.perf_counter() - start) * 1000)
        scheduler.update(output, result)
    for _ in range(bench.timed_steps):
        start = time.perf_counter()
        engine.step()
        engine_ms.append((time.perf_counter() - start) * 1000)
    for request_id in ids:
        engine.abort_request(request_id)
    return statistics.median(runner_ms), statistics.median(engine_ms)


STEP_FLOOR_RATIO = 1.2
ASYNC_FLOOR_RATIO = 1.05  # issue 14: the CPU's planning hides behind the GPU step


def bench_engine_decode(copy_bw: float, bench: DecodeBench = DecodeBench()) -> list[list[object]]:
    """Rows for each batch: the runner step with graphs against the byte floor, and the async
    engine step against the runner step (judged on a GPU only)."""
    timings: dict[tuple[int, bool, bool], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "decode-bench-model", arch="llama",
                             overrides=bench.model, with_weights=False)
        for eager, overlapped in ((False, False), (False, True), (True, False)):
            engine = make_engine(folder, eager, overlapped, bench)
            runner = engine.runner
            weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
            kv_per_token = runner.kv_bytes_per_block // runner.block_size
            for batch in bench.batches:
                timings[batch, eager, overlapped] = time_decode(engine, batch, bench)
                graphs = "graphs" if bench.device == "cuda" else "no graphs on CPU"
                mode = ("eager" if eager else graphs) + (", async" if overlapped else "")
                runner_ms, engine_ms = timings[batch, eager, overlapped]
                print(f"  batch {batch} {mode}: runner {runner_ms:.2f} ms, engine {engine_ms:.2f} ms",
                      flush=True)
            del engine, runner
            gc.collect()
            if bench.device == "cuda":
                torch.cuda.empty_cache()
    judged = bench.device == "cuda"
    shape = f"{_shape_name(bench.model)}, batch {{}} x ctx {bench.context}"
    rows: list[list[object]] = []
    for batch in bench.batches:
        floor_ms = (weight_bytes + batch * bench.context * kv_per_token) / copy_bw * 1000
        runner_ms, engine_ms = timings[batch, False, False]
        eager_runner_ms, eager_engine_ms = timings[batch, True, False]
        ratio = runner_ms / floor_ms
        rows.append([
            "engine decode step",
            shape.format(batch) + (", CUDA graphs" if judged else ", eager (CPU)"),
            f"{ratio:.2f}x byte floor ({runner_ms:.2f} ms vs {floor_ms:.2f} ms; engine step "
            f"{engine_ms:.2f} ms; eager runner {eager_runner_ms:.2f} ms, engine {eager_engine_ms:.2f} ms)",
            f"<= {STEP_FLOOR_RATIO}x",
            _verdict(judged, ratio <= STEP_FLOOR_RATIO),
        ])
        async_engine_ms = timings[batch, False, True][1]
        overlap = async_engine_ms / runner_ms
        rows.append([
            "engine step, async scheduling",
            shape.format(batch) + (", CUDA graphs" if judged else ", eager (CPU)"),
            f"{overlap:.2f}x runner step ({async_engine_ms:.2f} ms vs {runner_ms:.2f} ms; "
            f"synchronous engine step {engine_ms:.2f} ms)",
            f"<= {ASYNC_FLOOR_RATIO}x",
            _verdict(judged, overlap <= ASYNC_FLOOR_RATIO),
        ])
    return rows


def _shape_name(model: dict[str, Any]) -> str:
    if model == LLAMA_32_1B:
        return "Llama-3.2-1B shape"
    return f"{model['num_hidden_layers']} layers x hidden {model['hidden_size']}"


def _verdict(judged: bool, ok: bool) -> str:
    if not judged:
        return "- (a GPU floor)"
    return "ok" if ok else "BELOW FLOOR"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the table here as markdown as well")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("engine_decode_bench needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    rows = bench_engine_decode(bandwidth)
    lines = [f"Copy bandwidth {bandwidth / 1e9:.0f} GB/s.", "",
             "| section | case | measured | floor | verdict |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
