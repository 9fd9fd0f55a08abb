"""How long the holder's side of a pull takes: `export_blocks_unlocked` on a real engine, idle
and beside an engine thread kept busy with decodes (no Ray: the copy alone).

    python -m iterserve.loadtests.studies.kv_pull.export_time [--prompt-tokens 512] [--reps 8]

The built-in SmolLM2-135M, 16-token blocks, a 0.5 GiB host tier, one torch thread; a prompt
of --prompt-tokens is served once, then its cached blocks are exported --reps times with the
engine idle, then again while another thread steps the engine through two 64-token requests
of 48 tokens each, back to back (what kv_pull_bench's busy holder does), at Python's default
GIL switch interval (5 ms) and at 0.5 ms. Prints the median and the range, in ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time

import torch

from iterserve.replica import EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.kv_transfer import export_blocks_unlocked
from iterserve.replica.model_source import builtin_model_path

ALL = 1 << 40  # no byte bound


def export_times(engine: LLMEngine, prompt: list[int], reps: int) -> tuple[int, list[float]]:
    """(bytes exported, seconds per export)."""
    seconds, nbytes = [], 0
    for _ in range(reps):
        start = time.perf_counter()
        nbytes = export_blocks_unlocked(engine, prompt, b"", 0, ALL).nbytes
        seconds.append(time.perf_counter() - start)
    return nbytes, seconds


def keep_busy(engine: LLMEngine, stop: threading.Event, rng: random.Random) -> None:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    while not stop.is_set():
        if not engine.has_unfinished_requests():
            for _ in range(2):
                engine.add_request([rng.randrange(10, 4000) for _ in range(64)], params)
        engine.step()


def report(label: str, nbytes: int, seconds: list[float]) -> None:
    ms = sorted(s * 1e3 for s in seconds)
    print(f"{label}: {nbytes / 1e6:.1f} MB, export {statistics.median(ms):.1f} ms median "
          f"({ms[0]:.1f}-{ms[-1]:.1f})", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the exported prompt")
    parser.add_argument("--reps", type=int, default=8, help="exports per condition")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(builtin_model_path()), block_size=16, num_gpu_blocks_override=256,
        kv_offloading_size=0.5))
    rng = random.Random(0)
    prompt = [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    report("idle engine", *export_times(engine, prompt, args.reps))
    stop = threading.Event()
    busy = threading.Thread(target=keep_busy, args=(engine, stop, rng), daemon=True)
    busy.start()
    time.sleep(1.0)
    default_interval = sys.getswitchinterval()
    try:
        for interval in (default_interval, 0.0005):
            sys.setswitchinterval(interval)
            report(f"busy engine thread, GIL switch interval {interval * 1e3:.1f} ms",
                   *export_times(engine, prompt, args.reps))
    finally:
        sys.setswitchinterval(default_interval)
        stop.set()
        busy.join()


if __name__ == "__main__":
    main()
