"""TTFT of a prompt whose prefix another replica holds: pulled from it, hit locally in the host
tier, or recomputed (loadtests/studies/kv_pull/README.md has the question and the findings).

Two LLMReplicas on a local Ray Serve (CPU, `num_gpus_per_replica` 0), a host KV tier on each,
`kv_pull=always` (the pull is measured whatever the cost rule would say; the rule's verdict on
the measured rates is printed beside it). Replica A (the holder) is kept busy by background
streams the whole time. Each round, in turn:

    pull       a fresh prompt is served on A, then sent to B with A's hint: B pulls A's blocks
    host       a fresh prompt is served on B, fillers of the same length push all its blocks
               out of B's device into B's host tier (as many as fill the device KV), then it is
               sent to B again: a local host-tier hit, every block of it
    recompute  a fresh prompt nobody holds is sent to B

Only the last request of each arm is timed: TTFT from the handle call to its first token,
as the driver sees it (no HTTP). Requests reach one replica through `route_to_replica`.

    python -m iterserve.loadtests.studies.kv_pull.kv_pull_bench --rounds 100 \
        --out loadtests/studies/kv_pull/results/smollm2.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from iterserve.autoscale.kv_pull_cost import pull_beats_compute
from iterserve.autoscale.percentile import percentile
from iterserve.replica.sampling_params import SamplingParams

ARMS = ("pull", "host", "recompute")
TIMED = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
BUSY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
_ids = itertools.count()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M")
    parser.add_argument("--rounds", type=int, default=100, help="rounds, one request per arm")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each prompt")
    parser.add_argument("--busy-streams", type=int, default=2,
                        help="background streams keeping the holder busy")
    parser.add_argument("--device-blocks", type=int, default=72,
                        help="KV blocks per replica's device cache (small: fillers evict)")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    return parser.parse_args()


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(n)]


def first_token(handle: Any, tokens: list[int], replica: str, params: SamplingParams,  # noqa: ANN401
                **kwargs: Any) -> tuple[float, int]:  # noqa: ANN401
    """(seconds to the first token, cached prompt tokens) of one request placed on replica."""
    start = time.perf_counter()
    stream = handle.options(stream=True).generate.remote(
        tokens, params, f"kvpull-{next(_ids)}", route_to_replica=replica, **kwargs)
    ttft, cached = None, 0
    for output in stream:
        if ttft is None and output.new_token_ids:
            ttft = time.perf_counter() - start
            cached = output.num_cached_tokens
    return ttft or 0.0, cached


def keep_busy(handle: Any, replica: str, stop: threading.Event, seed: int) -> None:  # noqa: ANN401
    rng = random.Random(seed)
    while not stop.is_set():
        first_token(handle, prompt(rng, 64), replica, BUSY)


def replica_ids(handle: Any) -> list[str]:  # noqa: ANN401
    seen: set[str] = set()
    while len(seen) < 2:
        seen.update(handle.info.remote().result()["replica_id"] for _ in range(6))
    return sorted(seen)


def run_rounds(handle: Any, holder: str, receiver: str, args: argparse.Namespace  # noqa: ANN401
               ) -> dict[str, list[dict[str, float]]]:
    rng = random.Random(41)
    n, block = args.prompt_tokens, 16
    # Until the fillers alone have taken every device block, some of the prompt's stay there
    # (two fillers left 8 of 31 blocks on the device: a partial device hit, not a host hit).
    fillers = -(-args.device_blocks // (n // block))
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for round_index in range(args.rounds):
        order = ARMS if round_index % 2 == 0 else ARMS[::-1]  # alternate who goes first
        for arm in order:
            tokens = prompt(rng, n)
            if arm == "pull":
                first_token(handle, tokens, holder, TIMED)
                hint = (holder, (n - 1) // block * block)
                ttft, cached = first_token(handle, tokens, receiver, TIMED, kv_pull_hint=hint)
            elif arm == "host":
                first_token(handle, tokens, receiver, TIMED)
                for _ in range(fillers):
                    first_token(handle, prompt(rng, n), receiver, TIMED)
                ttft, cached = first_token(handle, tokens, receiver, TIMED)
            else:
                ttft, cached = first_token(handle, tokens, receiver, TIMED)
            results[arm].append({"round": round_index, "ttft_s": ttft, "cached": cached})
        if round_index % 10 == 9:
            print(f"round {round_index + 1}: " + ", ".join(
                f"{arm} p50 {percentile([r['ttft_s'] for r in results[arm]], 50) * 1e3:.0f} ms"
                for arm in ARMS), flush=True)
    return results


def summary(results: dict[str, list[dict[str, float]]], info: dict[str, Any],  # noqa: ANN401
            bytes_per_token: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm, rows in results.items():
        ttfts = [r["ttft_s"] for r in rows]
        out[arm] = {"n": len(rows), "p50_ms": percentile(ttfts, 50) * 1e3,
                    "p90_ms": percentile(ttfts, 90) * 1e3,
                    "cached_tokens_median": percentile([r["cached"] for r in rows], 50)}
    stats = info["stats"]
    rate = stats.get("prefill_token_rate") or None
    cached = out["pull"]["cached_tokens_median"]
    out["pull_over_host_p50"] = out["pull"]["p50_ms"] / out["host"]["p50_ms"]
    out["pull_over_recompute_p50"] = out["pull"]["p50_ms"] / out["recompute"]["p50_ms"]
    out["receiver_kv_pulls"] = info["kv_pulls"]
    out["receiver_prefill_token_rate"] = rate
    out["cost_rule_would_pull"] = pull_beats_compute(
        int(cached), int(cached) * bytes_per_token, 500e6, rate)
    return out


def main() -> None:
    args = parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from iterserve.deploy.app import APP_NAME, build_app

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=512 * 2**20)
    serve.start(http_options={"host": "127.0.0.1", "port": 0}, proxy_location="Disabled")
    app_args = {"num_replicas": 2, "router": "kv", "num_gpus_per_replica": 0,
                "kv_offloading_size": 0.5, "kv_pull": "always", "kv_pull_timeout_s": 10.0,
                "num_gpu_blocks_override": args.device_blocks,
                "max_model_len": args.device_blocks * 16, "device": "cpu"}
    if args.model:
        app_args["model"] = args.model
    serve.run(build_app(app_args), name=APP_NAME, route_prefix=None)
    handle = serve.get_deployment_handle("LLMReplica", APP_NAME)
    holder, receiver = replica_ids(handle)
    stop = threading.Event()
    busy = [threading.Thread(target=keep_busy, args=(handle, holder, stop, i), daemon=True)
            for i in range(args.busy_streams)]
    for thread in busy:
        thread.start()
    started = time.time()
    try:
        results = run_rounds(handle, holder, receiver, args)
    finally:
        stop.set()
    info = handle.info.remote(route_to_replica=receiver).result()
    exported = handle.info.remote(route_to_replica=holder).result()["kv_exported"]
    pulled = info["kv_pulled"]
    bytes_per_token = pulled["bytes"] // max(1, pulled["tokens"])
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "app_args": app_args,
              "seconds": time.time() - started, "load_average_end": os.getloadavg(),
              "model": info["model_path"], "kv_pulled": pulled,
              "holder_kv_exported": exported,
              "summary": summary(results, info, bytes_per_token), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({key: report[key] for key in ("summary", "kv_pulled", "holder_kv_exported")},
                     indent=1, default=str))
    for thread in busy:
        thread.join(timeout=30)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
