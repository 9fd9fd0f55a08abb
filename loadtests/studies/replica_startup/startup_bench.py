"""A replica's start-up, stage by stage, offline and on Ray Serve, cold and warm.

    python -m iterserve.loadtests.studies.replica_startup.startup_bench [--repeats 3]
        [--models builtin hf] [--parts offline serve] [--out DIR]

Models: the built-in SmolLM2 GGUF, and an HF safetensors checkpoint of 516M parameters with
random bf16 weights written once (`checkpoint.write_bench_checkpoint`). Modes: cold (every
file of the model dropped from the page cache with posix_fadvise(POSIX_FADV_DONTNEED) before
the start) and warm (read once before). Parts:

* offline: `startup_child` in a fresh process per start: interpreter start (actor_start),
  imports, the engine's stages, the first token of one request. With `--before DIR` (a
  checkout of older code), its starts alternate with this checkout's, start by start.
* serve: an app with min_replicas 0 on a local Ray; one request at zero replicas starts the
  replica: actor_start is the request's send to the replica's constructor (Serve's scale
  decision, the actor's process, the class's module), then the replica's own stages
  (`/debug/replicas`), then first_token from the constructor's end to the request's first
  token (Serve routing the held request, the first step).

Each start's stages are checked against its wall time (spawn or request -> first token):
every stage is timed on its own, so what no stage covers (glue between them) shows as the sum
falling short of the wall; the floor is 95 %. On Serve, actor_start and first_token are the
edges between the request and the replica's own clock readings (its constructor's first
line and end), so there the check is the replica's timed stages against its constructor.
Writes startup.json (every run) and startup.md (medians with min-max) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from iterserve.autoscale.percentile import percentile
from iterserve.loadtests.studies.replica_startup.checkpoint import (
    drop_page_cache,
    model_files,
    read_through,
    write_bench_checkpoint,
)
from iterserve.replica.startup import STAGES

RESULTS = Path(__file__).parent / "results"


CHILD = "iterserve.loadtests.studies.replica_startup.startup_child"
# Runs a module of another checkout (`--before DIR`) with this environment's packages: the
# editable install's finder (which maps iterserve.* to this checkout) is taken out first, and
# DIR's rooms are linked in as iterserve.* (as scripts/gpu_first_light.sh does).
LAUNCH_OTHER = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' "
                "not in repr(f).lower()]; sys.path.insert(0, sys.argv.pop(1)); "
                "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")
ROOMS = ("replica", "kernels", "dashboards", "autoscale", "deploy", "loadtests")


def link_checkout(checkout: Path) -> Path:
    """A folder that makes `checkout` importable as iterserve.* (symbolic links)."""
    site = Path(tempfile.mkdtemp(prefix="iterserve-before-"))
    (site / "iterserve").mkdir()
    shutil.copy(checkout / "iterserve" / "__init__.py", site / "iterserve" / "__init__.py")
    for room in ROOMS:
        (site / "iterserve" / room).symlink_to(checkout.resolve() / room)
    return site


def offline_start(model: str, cold: bool, cpu_threads: int,
                  other_site: Path | None = None) -> dict[str, Any]:
    """One start in a fresh process (of this checkout, or of the one linked at other_site):
    its stages, with actor_start = spawn -> first line."""
    files = model_files(model)
    drop_page_cache(files) if cold else read_through(files)
    launch = ["-m", CHILD] if other_site is None else ["-c", LAUNCH_OTHER, str(other_site),
                                                       CHILD]
    spawned = time.monotonic()
    out = subprocess.run([sys.executable, *launch, model, "--cpu-threads", str(cpu_threads)],
                         capture_output=True, text=True, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    stages = {"actor_start": {"seconds": child["first_line"] - spawned, "bytes_read": 0.0,
                              "bytes_copied": 0.0}, **child["stages"]}
    return {"stages": stages, "wall_s": child["first_token"] - spawned}


def offline_runs(models: dict[str, str], sites: dict[str, Path | None], repeats: int,
                 cpu_threads: int) -> list[dict[str, Any]]:
    """Every (model, mode, repeat), each checkout's start alternated with the other's."""
    runs = []
    for name, model in models.items():
        for mode in ("cold", "warm"):
            for repeat in range(repeats):
                for part, site in sites.items():
                    run = offline_start(model, mode == "cold", cpu_threads, site)
                    runs.append({"model": name, "part": part, "mode": mode, "repeat": repeat,
                                 **run})
                    print(f"{part} {name} {mode} #{repeat}: {run['wall_s']:.2f} s", flush=True)
    return runs


def serve_starts(models: dict[str, str], repeats: int) -> list[dict[str, Any]]:
    """Each (model, mode, repeat): a fresh app at zero replicas, one request starts one."""
    import openai
    import ray
    from ray import serve

    from iterserve.autoscale.autoscaling_policy import autoscaling_env_vars
    from iterserve.autoscale.config import AutoscaleConfig
    from iterserve.deploy.app import APP_NAME, build_app
    from iterserve.loadtests.servers import free_port, interrupt_on_termination, wait_until_ready

    os.environ.update(autoscaling_env_vars(AutoscaleConfig()))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 1024**2, namespace="replica-startup")
    interrupt_on_termination()
    runs = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        base_url = f"http://127.0.0.1:{port}"
        for name, model in models.items():
            for mode in ("cold", "warm"):
                for repeat in range(repeats):
                    serve.run(build_app({"model": model, "device": "cpu",
                                         "num_gpus_per_replica": 0, "num_replicas": "auto",
                                         "min_replicas": 0, "max_replicas": 1,
                                         "hold_timeout_s": 600}),
                              name=APP_NAME, route_prefix="/", blocking=False)
                    wait_until_ready(base_url, timeout_s=300)
                    files = model_files(model)
                    drop_page_cache(files) if mode == "cold" else read_through(files)
                    run = serve_one(openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                                  max_retries=0, timeout=600), base_url)
                    runs.append({"model": name, "part": "serve", "mode": mode,
                                 "repeat": repeat, **run})
                    print(f"serve {name} {mode} #{repeat}: {run['wall_s']:.2f} s", flush=True)
                    serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    return runs


def serve_one(client: Any, base_url: str) -> dict[str, Any]:  # noqa: ANN401
    import httpx

    model = client.models.list().data[0].id
    sent = time.monotonic()
    first = None
    for chunk in client.completions.create(model=model, prompt="Hello", max_tokens=1,
                                           temperature=0.0, stream=True):
        if first is None and chunk.choices:
            first = time.monotonic()
    infos = httpx.get(f"{base_url}/debug/replicas", timeout=30).json()["data"]
    replica = infos[0]["startup"]
    stages = {"actor_start": {"seconds": replica["started_at"] - sent, "bytes_read": 0.0,
                              "bytes_copied": 0.0},
              **replica["stages"],
              "first_token": {"seconds": first - replica["ready_at"], "bytes_read": 0.0,
                              "bytes_copied": 0.0}}
    return {"stages": stages, "wall_s": first - sent}


def table(runs: list[dict[str, Any]], model: str) -> list[str]:
    """One model's table: a column per (part, mode), medians with min-max."""
    columns = [(part, mode) for part in ("offline-before", "offline", "serve")
               for mode in ("cold", "warm")
               if any(r["model"] == model and (r["part"], r["mode"]) == (part, mode)
                      for r in runs)]
    def cell(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
        if not values:
            return "-"
        v = [x / scale for x in values]
        return (f"{percentile(v, 50):.{digits}f}" if len(v) == 1 else
                f"{percentile(v, 50):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})")
    lines = ["| stage | " + " | ".join(f"{p} {m} s" for p, m in columns) + " |",
             "|---|" + "---|" * len(columns)]
    chosen = {c: [r for r in runs if r["model"] == model and (r["part"], r["mode"]) == c]
              for c in columns}
    for stage in STAGES:
        if any(stage in r["stages"] for rs in chosen.values() for r in rs):
            lines.append(f"| {stage} | " + " | ".join(
                cell([r["stages"][stage]["seconds"] for r in chosen[c] if stage in r["stages"]])
                for c in columns) + " |")
    sums = {c: [sum(s["seconds"] for s in r["stages"].values()) for r in chosen[c]]
            for c in columns}
    lines.append("| **sum of stages** | " + " | ".join(cell(sums[c]) for c in columns) + " |")
    lines.append("| **wall (start -> first token)** | " + " | ".join(
        cell([r["wall_s"] for r in chosen[c]]) for c in columns) + " |")
    lines.append("| sum / wall | " + " | ".join(cell(
        [100 * s / r["wall_s"] for s, r in zip(sums[c], chosen[c], strict=True)], digits=1)
        + " %" for c in columns) + " |")
    for stage, key in (("weights_read", "bytes_read"), ("model_config", "bytes_read"),
                       ("weights_place", "bytes_copied"), ("kv_cache", "bytes_copied")):
        lines.append(f"| {stage} {key.replace('_', ' ')} (MB) | " + " | ".join(
            cell([r["stages"][stage][key] for r in chosen[c] if stage in r["stages"]],
                 scale=1e6, digits=0) for c in columns) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=("builtin", "hf"),
                        default=["builtin", "hf"], help="which models to start")
    parser.add_argument("--parts", nargs="+", choices=("offline", "serve"),
                        default=["offline", "serve"], help="offline starts, Serve starts, both")
    parser.add_argument("--repeats", type=int, default=3, help="starts per (model, mode)")
    parser.add_argument("--serve-repeats", type=int, default=2,
                        help="Serve starts per (model, mode)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="offline starts' torch threads (a replica here runs 1)")
    parser.add_argument("--hf-dir", type=Path, default=None,
                        help="where the 516M-parameter checkpoint is (written if missing)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--note", default="", help="a line saying what this run measures")
    parser.add_argument("--before", type=Path, default=None,
                        help="a checkout of older code (git archive COMMIT | tar -x -C DIR): "
                        "its offline starts alternate with this one's, side by side")
    args = parser.parse_args(argv)
    from iterserve.replica.model_source import builtin_model_path

    models = {}
    if "builtin" in args.models:
        models["builtin"] = str(builtin_model_path())
    if "hf" in args.models:
        models["hf"] = str(write_bench_checkpoint(args.hf_dir))
    runs: list[dict[str, Any]] = []
    sites = {"offline": None}
    if args.before is not None:
        sites["offline-before"] = link_checkout(args.before)
    try:
        if "offline" in args.parts:
            runs += offline_runs(models, sites, args.repeats, args.cpu_threads)
    finally:
        if sites.get("offline-before") is not None:
            shutil.rmtree(sites["offline-before"])
    if "serve" in args.parts:
        runs += serve_starts(models, args.serve_repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"note": args.note, "load_average": os.getloadavg(), "models": models,
            "cpu_threads": args.cpu_threads, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    (args.out / "startup.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lines = [f"# Replica start-up by stage ({meta['time']})", "", args.note, "",
             f"Load average at the end: {meta['load_average'][0]:.1f}. Command: `python -m "
             f"iterserve.loadtests.studies.replica_startup.startup_bench "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`.", ""]
    for name in models:
        lines += [f"## {name}: {models[name]}", "", *table(runs, name), ""]
    (args.out / "startup.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
