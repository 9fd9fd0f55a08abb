"""The host and disk KV tiers, offline: returning-turn TTFT and no-reuse throughput, side by side.

    python -m iterserve.loadtests.studies.kv_tiers.kv_tiers_bench                 # tiny model
    python -m iterserve.loadtests.studies.kv_tiers.kv_tiers_bench --model builtin # SmolLM2-135M

Five engines alternate round by round (A B C D E, A B C D E, ...), so that noise from other
processes hits all alike:

  off      the device KV alone (`num_gpu_blocks_override` D), prefix caching on;
  host     the same device KV plus a host tier of H blocks (`kv_offloading_size`);
  big      no tier, the device KV enlarged by the tier's bytes (D + H blocks);
  small    the device KV plus a host tier too small for the working set (H / `--small-host`);
  disk     `small` plus a disk tier holding the working set (`kv_offloading_disk_path`, a
           fresh temporary folder each round): the prefixes the small host tier evicts are
           read back from disk (their read times reported).

Multi-turn chat: C conversations, each a first turn of `--first-tokens` then `--turns`
returning turns, each adding the previous answer and `--new-tokens` user tokens, so that every
returning turn carries the whole history (>= 2k tokens by default) as its cacheable prefix.
Turns go round-robin over the conversations, one request at a time, so TTFT is the prefill
alone (and the copies back); the working set (every conversation's history) is about
`--working-set` times the device KV, so with LRU on the device alone every returning turn
misses. Only returning turns are timed.

No reuse: `--unique` distinct prompts at once (16 running), none ever seen again, on a device KV
that evicts cached blocks all along (so the tier stores them): throughput with the tiers off,
a host tier (4x the device KV), and a host tier as large as the device KV with a disk tier
under it (so that blocks are written to disk all along), alternating.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from iterserve.replica.config import EngineConfig
from iterserve.replica.host_kv_tier import GIB
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.make_model import default_model_path
from iterserve.replica.model_source import builtin_model_path
from iterserve.replica.sampling_params import SamplingParams

BLOCK = 16


@dataclass(frozen=True)
class ChatWorkload:
    conversations: int
    first_tokens: int
    new_tokens: int
    answer_tokens: int
    turns: int  # returning turns per conversation

    def final_blocks(self) -> int:
        """Blocks one conversation holds at its last turn (prompt and answer)."""
        tokens = self.first_tokens + self.turns * (self.answer_tokens + self.new_tokens)
        return -(-(tokens + self.answer_tokens) // BLOCK)


@dataclass
class ChatRound:
    config: str
    ttfts_s: list[float] = field(default_factory=list)  # returning turns only
    cached_tokens: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.ttfts_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_for(model: str, threads: int, **kwargs: Any) -> LLMEngine:  # noqa: ANN401
    return LLMEngine(EngineConfig.from_kwargs(model=model, block_size=BLOCK, cpu_threads=threads,
                                              **kwargs))


def run_alone(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], float,
                                                                                int]:
    """One request to its end: (its tokens, its TTFT in seconds, its cached prompt tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(prompt, params)
    tokens: list[int] = []
    ttft, cached = 0.0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
            cached = output.num_cached_tokens
            if output.first_token_time is not None:
                ttft = output.first_token_time - output.arrival_time
    return tokens, ttft, cached


def chat_round(name: str, engine: LLMEngine, workload: ChatWorkload, seed: int) -> ChatRound:
    rng = random.Random(seed)
    histories = [[rng.randrange(10, 4000) for _ in range(workload.first_tokens)]
                 for _ in range(workload.conversations)]
    result = ChatRound(name)
    for turn in range(workload.turns + 1):
        for i, history in enumerate(histories):
            answer, ttft, cached = run_alone(engine, history, workload.answer_tokens)
            if turn > 0:
                result.ttfts_s.append(ttft)
                result.cached_tokens.append(cached)
            new = [rng.randrange(10, 4000) for _ in range(workload.new_tokens)]
            histories[i] = history + answer + new
    stats = engine.stats()
    result.stats = {"prefix_cache_hits": stats.prefix_cache_hits,
                    "host_cache_queries": stats.host_cache_queries,
                    "host_cache_hits": stats.host_cache_hits,
                    "disk_cache_queries": stats.disk_cache_queries,
                    "disk_cache_hits": stats.disk_cache_hits,
                    "disk_errors": {k: v for k, v in stats.disk_errors.items() if v},
                    "kv_offload_bytes": stats.kv_offload_bytes,
                    "kv_offload_seconds": {k: round(v, 4)
                                           for k, v in stats.kv_offload_seconds.items()}}
    disk = getattr(engine.runner, "disk_tier", None)
    if disk is not None:
        disk.close()  # its writer's queue finished, the thread stopped
    return result


def disk_read_ms_per_block(result: ChatRound) -> float | None:
    """The disk tier's read time per block read back, in ms (None: no disk reads)."""
    read_bytes = result.stats["kv_offload_bytes"].get("DISK_to_CPU", 0)
    if not read_bytes:
        return None
    blocks = result.stats["disk_cache_hits"] / BLOCK
    return result.stats["kv_offload_seconds"]["DISK_to_CPU"] / blocks * 1e3


def no_reuse_round(engine: LLMEngine, num_prompts: int, prompt_tokens: int, output_tokens: int,
                   seed: int) -> float:
    """Generated tokens per second over distinct prompts, all queued at once."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for _ in range(num_prompts):
        engine.add_request([rng.randrange(10, 4000) for _ in range(prompt_tokens)], params)
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny (iterserve-tiny), builtin, or a path")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--conversations", type=int, default=8, help="chats in the working set")
    parser.add_argument("--first-tokens", type=int, default=2048, help="a chat's first prompt")
    parser.add_argument("--new-tokens", type=int, default=128,
                        help="user tokens a returning turn adds")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--turns", type=int, default=3, help="returning turns per conversation")
    parser.add_argument("--working-set", type=float, default=4.0,
                        help="the chats' working set over the device KV")
    parser.add_argument("--small-host", type=float, default=4.0,
                        help="the small and disk cells' host tier: the working set over this")
    parser.add_argument("--disk-root", type=Path, default=None,
                        help="where the disk cell's temporary folders go (default: the temp dir)")
    parser.add_argument("--unique", type=int, default=48, help="no-reuse prompts per round")
    parser.add_argument("--unique-tokens", type=int, default=512,
                        help="no-reuse prompt length")
    parser.add_argument("--unique-output", type=int, default=32,
                        help="no-reuse output length")
    parser.add_argument("--skip-no-reuse", action="store_true",
                        help="the chat only, no throughput rounds")
    parser.add_argument("--skip-chat", action="store_true",
                        help="the no-reuse throughput rounds only")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    model = {"tiny": str(default_model_path()), "builtin": str(builtin_model_path())}.get(
        args.model, args.model)
    workload = ChatWorkload(args.conversations, args.first_tokens, args.new_tokens,
                            args.answer_tokens, args.turns)
    working_set = workload.conversations * workload.final_blocks()
    device = max(math.ceil(working_set / args.working_set), workload.final_blocks() + 1)
    host = working_set  # the tier holds the whole working set: it is the device's 4x
    bytes_per_block = engine_for(model, args.threads, num_gpu_blocks_override=device
                                 ).runner.kv_bytes_per_block
    host_gib = host * bytes_per_block / GIB
    small_host = math.ceil(working_set / args.small_host)
    small_gib = small_host * bytes_per_block / GIB
    disk_gib = 2 * working_set * bytes_per_block / GIB  # files carry a header: room to spare
    configs = {"off": dict(num_gpu_blocks_override=device),
               "host": dict(num_gpu_blocks_override=device, kv_offloading_size=host_gib),
               "big": dict(num_gpu_blocks_override=device + host),
               "small": dict(num_gpu_blocks_override=device, kv_offloading_size=small_gib),
               "disk": dict(num_gpu_blocks_override=device, kv_offloading_size=small_gib,
                            kv_offloading_disk_size=disk_gib)}
    print(f"model {model}; device KV {device} blocks, host tier {host} blocks "
          f"({host_gib:.3f} GiB), small host tier {small_host} blocks, disk tier "
          f"{disk_gib:.3f} GiB, working set {working_set} blocks; {args.threads} thread(s)")
    chat: dict[str, list[ChatRound]] = {name: [] for name in configs}
    for round_index in range(0 if args.skip_chat else args.rounds):
        for name, kwargs in configs.items():
            folder = None
            if name == "disk":
                folder = tempfile.mkdtemp(prefix="kv-disk-tier-", dir=args.disk_root)
                kwargs = dict(kwargs, kv_offloading_disk_path=folder)
            result = chat_round(name, engine_for(model, args.threads, **kwargs), workload,
                                seed=round_index)
            if folder is not None:
                shutil.rmtree(folder)
            chat[name].append(result)
            read_ms = disk_read_ms_per_block(result)
            print(f"round {round_index} {name:>5}: returning-turn TTFT p50 "
                  f"{result.percentile(0.5) * 1e3:8.1f} ms  p99 {result.percentile(0.99) * 1e3:8.1f}"
                  f" ms  cached {statistics.mean(result.cached_tokens):7.0f} tokens/turn"
                  + (f"  disk read {read_ms:.3f} ms/block" if read_ms is not None else "")
                  + f"  {result.stats}")
    summary = {name: {"ttft_p50_ms": statistics.median(r.percentile(0.5) for r in rounds) * 1e3,
                      "ttft_p99_ms": statistics.median(r.percentile(0.99) for r in rounds) * 1e3,
                      "p50_per_round_ms": [round(r.percentile(0.5) * 1e3, 1) for r in rounds]}
               for name, rounds in chat.items() if rounds}
    if summary:
        print("\nreturning-turn TTFT, median over rounds:")
        for name, figures in summary.items():
            print(f"  {name:>4}: p50 {figures['ttft_p50_ms']:8.1f} ms  "
                  f"p99 {figures['ttft_p99_ms']:8.1f} ms")
        off, host_p50, big, small, disk = (summary[n]["ttft_p50_ms"]
                                           for n in ("off", "host", "big", "small", "disk"))
        print(f"  off / host {off / host_p50:.2f}x;  host / big {host_p50 / big:.2f}x;  "
              f"off / disk {off / disk:.2f}x;  small / disk {small / disk:.2f}x;  "
              f"disk / host {disk / host_p50:.2f}x")
        for pair in (("off", "disk"), ("small", "disk"), ("disk", "host")):
            ratios = [a.percentile(0.5) / b.percentile(0.5)
                      for a, b in zip(chat[pair[0]], chat[pair[1]], strict=True)]
            print(f"  per-round p50 {pair[0]} / {pair[1]}: "
                  + ", ".join(f"{ratio:.2f}" for ratio in ratios))
    throughput: dict[str, list[float]] = {"off": [], "host": [], "disk": []}
    if not args.skip_no_reuse:
        nr_device = 16 * -(-(args.unique_tokens + args.unique_output) // BLOCK) + 16
        nr_configs = {"off": dict(num_gpu_blocks_override=nr_device, max_num_seqs=16),
                      "host": dict(num_gpu_blocks_override=nr_device, max_num_seqs=16,
                                   kv_offloading_size=4 * nr_device * bytes_per_block / GIB),
                      "disk": dict(num_gpu_blocks_override=nr_device, max_num_seqs=16,
                                   kv_offloading_size=nr_device * bytes_per_block / GIB,
                                   kv_offloading_disk_size=disk_gib + 1.0)}
        for round_index in range(args.rounds):
            for name, kwargs in nr_configs.items():
                folder = None
                if name == "disk":
                    folder = tempfile.mkdtemp(prefix="kv-disk-tier-", dir=args.disk_root)
                    kwargs = dict(kwargs, kv_offloading_disk_path=folder)
                engine = engine_for(model, args.threads, **kwargs)
                rate = no_reuse_round(engine, args.unique, args.unique_tokens, args.unique_output,
                                      seed=100 + round_index)
                throughput[name].append(rate)
                stats = engine.stats()
                if folder is not None:
                    engine.runner.disk_tier.close()
                    shutil.rmtree(folder)
                print(f"no reuse, round {round_index} {name:>4}: {rate:8.1f} generated tokens/s"
                      f"  copies {stats.kv_offload_bytes} bytes {stats.kv_offload_seconds} s"
                      f"  disk errors {stats.disk_errors}")
        off_rate, host_rate, disk_rate = (statistics.median(throughput[n])
                                          for n in ("off", "host", "disk"))
        print(f"no reuse, median: off {off_rate:.1f}, host {host_rate:.1f}, host+disk "
              f"{disk_rate:.1f} tokens/s (host / off {host_rate / off_rate:.3f}, host+disk / off "
              f"{disk_rate / off_rate:.3f})")
        for name in ("host", "disk"):
            print(f"  per-round {name} / off: " + ", ".join(
                f"{a / b:.3f}" for a, b in zip(throughput[name], throughput["off"], strict=True)))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "args": vars(args) | {"out": str(args.out), "disk_root": str(args.disk_root)},
            "device_blocks": device,
            "host_blocks": host, "small_host_blocks": small_host, "summary": summary,
            "no_reuse_tokens_per_s": throughput,
            "chat_rounds": {n: [asdict(r) for r in rounds] for n, rounds in chat.items()},
        }, indent=1))


if __name__ == "__main__":
    main()
