"""The engine's CPU paths, part by part, old against new: prints figures, asserts nothing.

    python -m iterserve.loadtests.studies.engine_speed.cpu_paths_bench   # every part, 1 and 2 threads
    python -m iterserve.loadtests.studies.engine_speed.cpu_paths_bench --part decode --threads 2 \
        --rounds 5

* linear: every linear of one SmolLM2 forward (30 layers' qkv, o, gate+up and down, then the
  tied lm_head) at M rows: `F.linear` (MKL) against oneDNN with prepacked weights
  (replica/cpu_linear.py), and how far the logits move.
* decode: one layer's decode attention over a batch x context grid: the reference loop
  (kernels/reference.py, contiguous cache) against the compiled block decode
  (replica/cpu_attention.py, block-transposed K cache, the step's work list built once).
* prefill: one prefill chunk's attention, with and without a cached prefix: loop against SDPA.

Each part runs at 1 and 2 torch threads. Old and new alternate within every round (A B, B A,
...), each timed as the best of a few repeats; the table gives the medians over rounds, their
ratio and the range of the per-round ratios: on a shared machine only ratios mean anything.
SmolLM2's real weights for the linears; its shapes (3 KV heads x 3, head dim 64, blocks of 16)
with random values for attention.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from iterserve.kernels import reference
from iterserve.replica.cpu_attention import CpuAttention, chunk_after_prefix, decode_work
from iterserve.replica.cpu_linear import pack_linears
from iterserve.replica.loader import load_checkpoint
from iterserve.replica.model_source import resolve_model_path
from iterserve.replica.models.layers import Linear
from iterserve.replica.ops import select_ops

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16  # SmolLM2-135M
SCALE = HEAD_DIM**-0.5
DECODE_GRID = ((1, 512), (8, 512), (32, 128), (32, 512), (32, 2048), (64, 512), (64, 2048))
PREFILL_CASES = ((484, 0), (200, 300), (512, 1500), (2048, 0))
# A chunk after a cached prefix: (chunk tokens, cached tokens), at step budgets 256-2048.
AFTER_PREFIX_CASES = ((256, 3800), (512, 512), (512, 1500), (512, 3000), (2048, 2048))
ROWS = (1, 8, 32, 128, 512)

Timed = Callable[[], object]


def cpu_model_name() -> str:
    """The CPU's marketing name (the MKL/oneDNN gap is a property of the CPU)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def best_of(fn: Timed, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def compare(name: str, old: Timed, new: Timed, rounds: int, repeats: int,
            threads: int) -> None:
    """Alternate old and new for `rounds` rounds; print one table row."""
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for index in range(rounds):
        order = (("old", old), ("new", new)) if index % 2 == 0 else (("new", new), ("old", old))
        for arm, fn in order:
            times[arm].append(best_of(fn, repeats))
    old_ms, new_ms = (1000 * statistics.median(times[a]) for a in ("old", "new"))
    ratios = [o / n for o, n in zip(times["old"], times["new"], strict=True)]
    print(f"| {name} | {threads} | {old_ms:.2f} | {new_ms:.2f} | {old_ms / new_ms:.2f}x | "
          f"{min(ratios):.2f}-{max(ratios):.2f}x |", flush=True)


def header(title: str, old: str, new: str) -> None:
    print(f"\n{title}\n\n| case | threads | {old} ms | {new} ms | speed-up (medians) | "
          "per round |\n|---|---:|---:|---:|---:|---:|", flush=True)


def linear_part(model_path: Path, args: argparse.Namespace) -> None:
    model, _ = load_checkpoint(model_path, torch.float32, torch.device("cpu"),
                               select_ops("torch"))
    print(f"\nlinears: {pack_linears(model, 'onednn')}")
    layers = [[m for m in layer.modules() if isinstance(m, Linear)]
              for layer in model.model.layers]
    head = model.lm_head
    gen = torch.Generator().manual_seed(0)
    header("linears of one SmolLM2 forward (30 layers + lm_head) at M rows", "F.linear (MKL)",
           "oneDNN")
    for rows in ROWS:
        inputs = {id(m): torch.randn((rows, m.weight.shape[1]), generator=gen)
                  for modules in layers for m in modules}
        hidden = torch.randn((rows, head.weight.shape[1]), generator=gen)  # [M, H]

        def old(inputs: dict = inputs, hidden: torch.Tensor = hidden) -> None:
            for modules in layers:
                for m in modules:
                    F.linear(inputs[id(m)], m.weight, m.bias)
            F.linear(hidden, head.weight)

        def new(inputs: dict = inputs, hidden: torch.Tensor = hidden) -> None:
            for modules in layers:
                for m in modules:
                    m(inputs[id(m)])
            head(hidden)

        with torch.inference_mode():
            logits_old, logits_new = F.linear(hidden, head.weight), head(hidden)
            diff = float((logits_old - logits_new).abs().max())
            same = float((logits_old.argmax(-1) == logits_new.argmax(-1)).float().mean())
            for threads in args.threads:
                compare(f"M={rows} (logits max diff {diff:.1e}, argmax same {same:.0%})",
                        old, new, args.rounds, args.repeats, threads)


def paged_cache(seq_lens: list[int], transposed: bool, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables [S, M] int32) with shuffled blocks."""
    blocks = [-(-n // BLOCK) for n in seq_lens]
    total = sum(blocks) + 1
    k = torch.randn((total, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    v = torch.randn((total, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    if transposed:  # the engine's storage for the block decode: [N, Hkv, D, B]
        k = k.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    order = torch.randperm(total, generator=gen)
    tables = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start : start + n]
        start += n
    return k, v, tables


def decode_part(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    attention = CpuAttention("sdpa", "blocks")
    start = time.perf_counter()
    k, v, tables = paged_cache([40, 300], True, gen)
    attention.warm_up((k, v), KV_HEADS * GROUP, torch.float32)
    print(f"\ndecode attention: compile {time.perf_counter() - start:.1f} s (a warm inductor "
          f"cache: seconds); path {attention.paths['decode_attention']}")
    header("decode attention, one layer (x30 for a SmolLM2 step)", "loop", "blocks")
    for batch, context in DECODE_GRID:
        lens = [max(1, int(n)) for n in np.random.default_rng(0).integers(
            context // 2, context * 3 // 2, batch)]  # contexts around `context`
        k, v, tables = paged_cache(lens, True, gen)
        k_flat = k.contiguous()  # the loop's engine layout
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        query = torch.randn((batch, KV_HEADS * GROUP, HEAD_DIM), generator=gen)
        starts = torch.arange(batch + 1, dtype=torch.int32)
        work = torch.from_numpy(decode_work(seq_lens.numpy(), tables.numpy(), BLOCK))

        def old(q: torch.Tensor = query, k: torch.Tensor = k_flat, v: torch.Tensor = v,
                s: torch.Tensor = starts, n: torch.Tensor = seq_lens,
                t: torch.Tensor = tables) -> None:
            reference.paged_attention(q, k, v, s, n, t, SCALE)

        def new(q: torch.Tensor = query, k: torch.Tensor = k, v: torch.Tensor = v,
                s: torch.Tensor = starts, n: torch.Tensor = seq_lens, t: torch.Tensor = tables,
                w: torch.Tensor = work) -> None:
            attention.paged_attention(q, k, v, s, n, t, SCALE, num_decodes=q.shape[0],
                                      split_work=w)

        for threads in args.threads:
            compare(f"batch {batch}, context ~{context}", old, new, args.rounds, args.repeats,
                    threads)
    print(f"path after the grid: {attention.paths['decode_attention']}")


def prefill_part(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    attention = CpuAttention("sdpa", "loop")
    header("prefill attention, one chunk, one layer", "loop", "sdpa")
    for q_len, cached in PREFILL_CASES:
        k, v, tables = paged_cache([q_len + cached], False, gen)
        seq_lens = torch.tensor([q_len + cached], dtype=torch.int32)
        starts = torch.tensor([0, q_len], dtype=torch.int32)
        query = torch.randn((q_len, KV_HEADS * GROUP, HEAD_DIM), generator=gen)

        def old(q: torch.Tensor = query, k: torch.Tensor = k, v: torch.Tensor = v,
                s: torch.Tensor = starts, n: torch.Tensor = seq_lens,
                t: torch.Tensor = tables) -> None:
            reference.paged_attention(q, k, v, s, n, t, SCALE)

        def new(q: torch.Tensor = query, k: torch.Tensor = k, v: torch.Tensor = v,
                s: torch.Tensor = starts, n: torch.Tensor = seq_lens,
                t: torch.Tensor = tables) -> None:
            attention.paged_attention(q, k, v, s, n, t, SCALE)

        for threads in args.threads:
            compare(f"{q_len} tokens after {cached} cached", old, new, args.rounds,
                    max(1, args.repeats // 2), threads)


def after_prefix_part(args: argparse.Namespace) -> None:
    """A chunk after a cached prefix: the one masked SDPA call the engine made before, against
    chunk_after_prefix (two flash calls merged by log-sum-exp)."""
    gen = torch.Generator().manual_seed(0)
    header("prefill attention, a chunk after a cached prefix, one layer", "masked SDPA",
           "two flash calls")
    for q_len, cached in AFTER_PREFIX_CASES:
        length = q_len + cached
        q = torch.randn((1, KV_HEADS * GROUP, q_len, HEAD_DIM), generator=gen)
        k = torch.randn((1, KV_HEADS, length, HEAD_DIM), generator=gen)
        v = torch.randn((1, KV_HEADS, length, HEAD_DIM), generator=gen)

        def old(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                q_len: int = q_len, cached: int = cached) -> None:
            mask = torch.ones((q_len, q_len + cached), dtype=torch.bool).tril(cached)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE,
                                           enable_gqa=True)

        def new(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                cached: int = cached) -> None:
            chunk_after_prefix(q, k, v, cached, SCALE)

        for threads in args.threads:
            compare(f"{q_len} tokens after {cached} cached", old, new, args.rounds,
                    max(1, args.repeats // 2), threads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "linear", "decode", "prefill"], default="all",
                        help="which part to time (default: all three)")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2], help="comma-separated torch thread counts")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating old/new rounds; the table gives their medians")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timings per measurement, the best one kept")
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_model_name()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    with torch.inference_mode():
        if args.part in ("all", "linear"):
            linear_part(resolve_model_path(args.model), args)
        if args.part in ("all", "decode"):
            decode_part(args)
        if args.part in ("all", "prefill"):
            prefill_part(args)
            after_prefix_part(args)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
