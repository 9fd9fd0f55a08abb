"""Does /metrics tell the truth? Compare it with the engines' own state (/debug/replicas).

    python -m iterserve.loadtests.studies.reliability.metrics_truth --url http://127.0.0.1:8000 \
        --hangups 96 --max-tokens 400 [--prefix iterserve:] [--api-key KEY]

`hangup_storm` opens `num` streaming completions that each read 2-6 chunks and hang up (an
operator's disconnect storm). `metrics_view` parses the exposition into one record per replica
(running, waiting, KV usage, request_success by finish reason); `engine_view` reads the same
numbers from /debug/replicas. `disagreements` lists where the two differ, and
`wait_for_agreement` polls until they agree or a deadline passes, returning how long it took.

Traffic goes only to the URL given (meant for 127.0.0.1); every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iterserve.dashboards.metrics import (
    DEFAULT_PREFIX,
    KV_CACHE_USAGE_PERC,
    LABEL_FINISHED_REASON,
    LABEL_REPLICA,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    REQUEST_SUCCESS,
    metric_name,
)
from iterserve.loadtests.studies.reliability.chaos import Outcome, run_request

KV_TOLERANCE = 1e-6


@dataclass
class ReplicaView:
    """One replica's load and finished-request counts, from either side."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)  # finish reason -> count


async def hangup_storm(base_url: str, num: int = 96, max_tokens: int = 400,
                       headers: dict[str, str] | None = None, seed: int = 0,
                       chunks: tuple[int, int] = (2, 6)) -> list[Outcome]:
    """`num` streaming completions, each dropped after a random 2-6 chunks, all at once."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        jobs = [run_request(client, {"prompt": f"storm {i}: tell a long story",
                                     "max_tokens": max_tokens, "stream": True,
                                     "ignore_eos": True},
                            headers, stop_after_chunks=rng.randint(*chunks))
                for i in range(num)]
        return list(await asyncio.gather(*jobs))


def metrics_view(text: str, prefix: str = DEFAULT_PREFIX) -> dict[str, ReplicaView]:
    """Per-replica view of an exposition (the replica label keys the records)."""
    gauges = {metric_name(NUM_REQUESTS_RUNNING, prefix=prefix): "running",
              metric_name(NUM_REQUESTS_WAITING, prefix=prefix): "waiting",
              metric_name(KV_CACHE_USAGE_PERC, prefix=prefix): "kv_usage"}
    success = metric_name(REQUEST_SUCCESS, prefix=prefix)
    views: dict[str, ReplicaView] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            replica = sample.labels.get(LABEL_REPLICA)
            if replica is None:
                continue
            view = views.setdefault(replica, ReplicaView())
            if sample.name in gauges:
                setattr(view, gauges[sample.name], sample.value)
            elif sample.name == success:
                reason = sample.labels[LABEL_FINISHED_REASON]
                view.finished[reason] = view.finished.get(reason, 0.0) + sample.value
    return views


def engine_view(infos: list[dict[str, Any]]) -> dict[str, ReplicaView]:
    """Per-replica view of /debug/replicas (the engines' live snapshots)."""
    views = {}
    for info in infos:
        stats = info["stats"]
        views[str(info["replica_id"])] = ReplicaView(
            running=stats["num_running"], waiting=stats["num_waiting"],
            kv_usage=stats["kv_usage"], finished=dict(info.get("finished_by_reason") or {}))
    return views


def disagreements(metrics: dict[str, ReplicaView], engines: dict[str, ReplicaView],
                  compare_finished: bool = True) -> list[str]:
    """Where /metrics and the engines differ (empty: they agree), replica by replica."""
    problems = []
    for replica, engine in engines.items():
        seen = metrics.get(replica)
        if seen is None:
            problems.append(f"{replica}: absent from /metrics")
            continue
        for key in ("running", "waiting"):
            if getattr(seen, key) != getattr(engine, key):
                problems.append(f"{replica}: {key} metrics={getattr(seen, key)} "
                                f"engine={getattr(engine, key)}")
        if abs(seen.kv_usage - engine.kv_usage) > KV_TOLERANCE:
            problems.append(f"{replica}: kv_usage metrics={seen.kv_usage} "
                            f"engine={engine.kv_usage}")
        if compare_finished:
            reasons = set(engine.finished) | {r for r, v in seen.finished.items() if v}
            for reason in sorted(reasons):
                if seen.finished.get(reason, 0.0) != engine.finished.get(reason, 0):
                    problems.append(f"{replica}: request_success[{reason}] metrics="
                                    f"{seen.finished.get(reason, 0.0)} "
                                    f"engine={engine.finished.get(reason, 0)}")
    return problems


def snapshot(base_url: str, headers: dict[str, str] | None = None,
             prefix: str = DEFAULT_PREFIX) -> tuple[dict[str, ReplicaView],
                                                    dict[str, ReplicaView]]:
    """(/metrics view, engine view), read one right after the other."""
    with httpx.Client(base_url=base_url, timeout=30, headers=headers) as client:
        engines = engine_view(client.get("/debug/replicas").json()["data"])
        metrics = metrics_view(client.get("/metrics").text, prefix)
    return metrics, engines


def wait_for_agreement(base_url: str, timeout_s: float, headers: dict[str, str] | None = None,
                       prefix: str = DEFAULT_PREFIX) -> tuple[float, list[str]]:
    """Poll until /metrics agrees with the engines; (seconds taken, last disagreements)."""
    start = time.monotonic()
    problems = ["not compared yet"]
    while time.monotonic() - start < timeout_s:
        problems = disagreements(*snapshot(base_url, headers, prefix))
        if not problems:
            break
        time.sleep(0.05)
    return time.monotonic() - start, problems


def finished_totals(views: dict[str, ReplicaView]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for view in views.values():
        for reason, count in view.finished.items():
            totals[reason] = totals.get(reason, 0.0) + count
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--hangups", type=int, default=96,
                        help="streams hung up mid-answer before the comparison")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens each stream asks for")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help="the metric names' prefix (iterserve: or vllm:)")
    parser.add_argument("--api-key", default=None, help="Bearer key, if the server wants one")
    parser.add_argument("--wait-s", type=float, default=20.0,
                        help="seconds to wait for /metrics and the engines to agree")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    outcomes = asyncio.run(hangup_storm(args.url, args.hangups, args.max_tokens, headers))
    print(f"sent {len(outcomes)} streams, {sum(o.num_chunks for o in outcomes)} chunks read")
    waited, problems = wait_for_agreement(args.url, args.wait_s, headers, args.prefix)
    metrics, engines = snapshot(args.url, headers, args.prefix)
    print(json.dumps({"waited_s": round(waited, 3), "disagreements": problems,
                      "metrics": {k: asdict(v) for k, v in metrics.items()},
                      "engines": {k: asdict(v) for k, v in engines.items()}}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
