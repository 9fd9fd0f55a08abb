"""Soak run: a bounded, headless Locust run against a local Serve app, sampling replica RSS.

    python -m iterserve.loadtests.studies.reliability.soak --duration 600 --users 4 --warmup 60 \
        --out runs/soak

Starts a local Ray + Serve (127.0.0.1, a free port) running `build_app` with the built-in
tiny model on CPU (or `--runner simulated`), runs `locust -f loadtests/locustfile.py
--headless` for `--duration` seconds at `--users` closed-loop users, samples the RSS of every
LLMReplica, OpenAIIngress and proxy process every `--sample-interval` seconds, and at the end
checks the engine's block accounting through /debug/replicas (every block free, nothing
running or waiting).

Pass criteria (exit code 0): zero Locust failures, zero non-200 answers, every replica's RSS
growth after warm-up below `--max-rss-growth` (5 %), and exact accounting at the end. RSS
growth compares the median of the first 30 s after warm-up with the median of the last 30 s.
Everything lands in `--out`: summary.json, rss.csv, Locust's CSVs and its log.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from iterserve.loadtests.servers import free_port, interrupt_on_termination

REPO = Path(__file__).resolve().parents[3]  # loadtests/studies/reliability/soak.py
LOCUSTFILE = REPO / "loadtests" / "locustfile.py"
WINDOW_S = 30.0  # RSS medians are taken over windows this long


@contextlib.contextmanager
def local_serve(engine_kwargs: dict[str, Any], num_replicas: int) -> Iterator[str]:
    """Embedded Ray + Serve running build_app on 127.0.0.1; yields the base URL."""
    import ray
    from ray import serve

    from iterserve.deploy.app import APP_NAME, build_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024**2, namespace=f"iterserve-soak-{port}")
    interrupt_on_termination()  # a SIGTERM still shuts this cluster down (servers.py)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        app = build_app({"engine_kwargs": engine_kwargs, "num_replicas": num_replicas})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet; the deadline below bounds the wait
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base_url} not ready after 300 s")
            time.sleep(0.5)
        yield base_url
    finally:
        serve.shutdown()
        ray.shutdown()


def session_pids() -> dict[str, list[int]]:
    """PIDs of this Ray session's Serve actors, by role (read from the GCS)."""
    import ray

    roles = {"LLMReplica": [], "OpenAIIngress": [], "ProxyActor": []}
    for info in ray._private.state.actors().values():
        if info["State"] != "ALIVE" or not info.get("Pid"):
            continue
        for role, pids in roles.items():
            if role in info["ActorClassName"]:
                pids.append(int(info["Pid"]))
    return roles


def rss_mb(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return None


def replica_infos(base_url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{base_url}/debug/replicas", timeout=30)
    response.raise_for_status()
    return response.json()["data"]


def wait_idle(base_url: str, timeout_s: float = 120) -> tuple[bool, list[dict[str, Any]]]:
    deadline = time.monotonic() + timeout_s
    stats: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        stats = [info["stats"] for info in replica_infos(base_url)]
        if stats and all(s["num_running"] == 0 and s["num_waiting"] == 0
                         and s["num_free_blocks"] == s["num_total_blocks"] for s in stats):
            return True, stats
        time.sleep(0.5)
    return False, stats


def locust_totals(csv_prefix: Path) -> dict[str, Any]:
    """Request and failure counts from Locust's `<prefix>_stats.csv`."""
    rows = list(csv.DictReader((csv_prefix.parent / f"{csv_prefix.name}_stats.csv").open()))
    by_name = {row["Name"]: row for row in rows}
    http_rows = [r for r in rows if r["Type"] not in ("METRIC", "") and r["Name"] != "Aggregated"]
    e2e = by_name.get("e2e", {})
    return {
        "requests": sum(int(r["Request Count"]) for r in http_rows),
        "failures": sum(int(r["Failure Count"]) for r in http_rows),
        "completed_streams": int(e2e.get("Request Count", 0) or 0),
        "e2e_p50_ms": e2e.get("50%"), "e2e_p99_ms": e2e.get("99%"),
        "ttft_p99_ms": by_name.get("ttft", {}).get("99%"),
    }


def rss_growth(samples: list[dict[str, Any]], pid: int, warmup_s: float
               ) -> dict[str, float | None]:
    series = [(s["t"], s["rss_mb"][str(pid)]) for s in samples
              if s["rss_mb"].get(str(pid)) is not None]
    if not series:
        return {"baseline_mb": None, "final_mb": None, "growth_pct": None}
    end = series[-1][0]
    base = [v for t, v in series if warmup_s <= t < warmup_s + WINDOW_S] or [series[0][1]]
    last = [v for t, v in series if t >= end - WINDOW_S]
    baseline, final = statistics.median(base), statistics.median(last)
    return {"baseline_mb": round(baseline, 1), "final_mb": round(final, 1),
            "max_mb": round(max(v for _, v in series), 1),
            "growth_pct": round(100 * (final - baseline) / baseline, 2)}


def run_soak(base_url: str, pids: dict[str, list[int]], args: argparse.Namespace,
             vocab_size: int) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / "locust"
    argv = [str(Path(sys.executable).with_name("locust")), "-f", str(LOCUSTFILE), "--headless",
            "--host", base_url, "-u", str(args.users), "-r", str(args.users),
            "-t", f"{int(args.duration)}s", "--csv", str(prefix), "--only-summary",
            "--workload-size", "512", "--workload-seed", str(args.seed),
            "--prompt-buckets", args.prompt_buckets, "--output-lengths", args.output_lengths,
            "--vocab-size", str(vocab_size), "--stop-timeout", "60"]
    samples: list[dict[str, Any]] = []
    all_pids = sorted({p for group in pids.values() for p in group})
    start = time.monotonic()
    with (out / "locust.log").open("w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        hard_deadline = start + args.duration + 180
        try:
            while proc.poll() is None and time.monotonic() < hard_deadline:
                samples.append({"t": round(time.monotonic() - start, 1),
                                "rss_mb": {str(p): rss_mb(p) for p in all_pids}})
                time.sleep(args.sample_interval)
        finally:
            if proc.poll() is None:
                proc.terminate()
            returncode = proc.wait(timeout=60)
    seconds = time.monotonic() - start
    with (out / "rss.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["t_s", *all_pids])
        for s in samples:
            writer.writerow([s["t"], *[s["rss_mb"][str(p)] for p in all_pids]])
    idle, stats = wait_idle(base_url)
    growth = {role: {pid: rss_growth(samples, pid, args.warmup) for pid in group}
              for role, group in pids.items()}
    replica_growth = [g["growth_pct"] for g in growth["LLMReplica"].values()]
    totals = locust_totals(prefix)
    summary = {
        "duration_s": args.duration, "wall_s": round(seconds, 1), "users": args.users,
        "warmup_s": args.warmup, "locust_exit_code": returncode, **totals,
        "rss": growth, "accounting_exact": idle, "replica_stats_after": stats,
        "num_samples": len(samples),
    }
    summary["passed"] = bool(
        totals["failures"] == 0 and totals["requests"] > 0 and returncode == 0 and idle
        and replica_growth and all(g is not None and g < args.max_rss_growth
                                   for g in replica_growth))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iterserve.loadtests.studies.reliability.soak",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="Locust run time, s")
    parser.add_argument("--users", type=int, default=4, help="Locust users")
    parser.add_argument("--warmup", type=float, default=60.0, help="RSS baseline starts here")
    parser.add_argument("--sample-interval", type=float, default=2.0,
                        help="seconds between replica RSS samples")
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="percent")
    parser.add_argument("--runner", choices=("model", "simulated"), default="model",
                        help="the real model or the simulated runner")
    parser.add_argument("--num-replicas", type=int, default=1, help="model replicas")
    parser.add_argument("--prompt-buckets", default="short:16-64:0.7,medium:64-160:0.3",
                        help="name:low-high:weight,... of the workload")
    parser.add_argument("--output-lengths", default="uniform:16-64",
                        help="fixed:N | uniform:LO-HI | exponential:MEAN:LO-HI")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--out", default="runs/soak",
                        help="folder for the Locust CSVs, RSS samples and the summary")
    args = parser.parse_args(argv)
    engine_kwargs: dict[str, Any] = {"max_model_len": 256, "num_gpu_blocks_override": 128,
                                     "max_num_seqs": 8, "runner": args.runner}
    if args.runner == "model":
        engine_kwargs["device"] = "cpu"
    with local_serve(engine_kwargs, args.num_replicas) as base_url:
        pids = session_pids()
        vocab = replica_infos(base_url)[0].get("vocab_size") or 4096
        summary = run_soak(base_url, pids, args, int(vocab))
    print(json.dumps({k: v for k, v in summary.items() if k != "replica_stats_after"}, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
