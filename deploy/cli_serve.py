"""`iterserve serve`: start Ray (embedded, or join a cluster) and deploy the application.

    iterserve serve                               # built-in SmolLM2, embedded Ray, :8000
    iterserve serve --model /models/llama --max-num-seqs 64 --port 8001 --api-key $KEY
    iterserve serve --address auto --num-replicas 4   # an existing cluster

Engine flags use vLLM's names; TensorRT-LLM's spellings are aliases (--max-batch-size,
--max-num-tokens, --kv-cache-free-gpu-memory-fraction, --tokens-per-block,
--enable-chunked-context). A flag left out keeps EngineConfig's default.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from iterserve.replica.config import ATTENTION_BACKENDS, BATCHING_MODES, DTYPES, SCHEDULER_POLICIES

logger = logging.getLogger("iterserve.serve")


@dataclass(frozen=True)
class EngineFlag:
    flags: tuple[str, ...]  # first is the vLLM name, the rest aliases
    dest: str  # EngineConfig.from_kwargs name
    type: Any = int
    choices: tuple[str, ...] | None = None
    help: str = ""


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag(("--served-model-name",), "served_model_name", str, None,
               "model name in the API (default: the model folder or file name)"),
    EngineFlag(("--max-num-seqs", "--max-batch-size"), "max_num_seqs", int, None,
               "most requests in one batch"),
    EngineFlag(("--max-num-batched-tokens", "--max-num-tokens"), "max_num_batched_tokens",
               int, None, "token budget of one iteration"),
    EngineFlag(("--gpu-memory-utilization", "--kv-cache-free-gpu-memory-fraction"),
               "gpu_memory_utilization", float, None, "fraction of GPU memory for the engine"),
    EngineFlag(("--block-size", "--tokens-per-block"), "block_size", int, None,
               "tokens per KV block"),
    EngineFlag(("--scheduler-policy",), "scheduler_policy", str, SCHEDULER_POLICIES),
    EngineFlag(("--batching",), "batching", str, BATCHING_MODES,
               "continuous (iteration-level) or static batching"),
    EngineFlag(("--max-model-len",), "max_model_len", int, None, "context length"),
    EngineFlag(("--num-gpu-blocks-override",), "num_gpu_blocks_override", int, None,
               "number of KV blocks (skips profiling)"),
    EngineFlag(("--cpu-kv-cache-bytes",), "cpu_kv_cache_bytes", int, None,
               "KV cache budget on CPU"),
    EngineFlag(("--swap-space",), "swap_space", float, None,
               "GiB of host swap for KV blocks (only 0: preemption recomputes)"),
    EngineFlag(("--dtype",), "dtype", str, DTYPES),
    EngineFlag(("--attention-backend",), "attention_backend", str, ATTENTION_BACKENDS),
    EngineFlag(("--device",), "device", str, None, "auto, cuda or cpu"),
    EngineFlag(("--max-waiting-requests",), "max_waiting_requests", int, None,
               "bound of each replica's waiting queue; beyond it requests get 429"),
    EngineFlag(("--max-logprobs",), "max_logprobs", int, None),
    EngineFlag(("--admission-min-free-slots",), "admission_min_free_slots", int),
    EngineFlag(("--admission-max-wait-ms",), "admission_max_wait_ms", float),
    EngineFlag(("--seed",), "seed", int, None, "engine random seed"),
)
ENGINE_BOOL_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--enable-chunked-prefill", "--enable-chunked-context"), "enable_chunked_prefill"),
    (("--enable-prefix-caching",), "enable_prefix_caching"),
    (("--enforce-eager",), "enforce_eager"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve serve", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="HF checkpoint folder, .gguf file, or iterserve-tiny (the tiny random-weight "
                             "test model); default: the built-in SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accepted Bearer key (repeatable; also env ITERSERVE_API_KEYS)")
    parser.add_argument("--api-key-file", default=None, help="file with one key per line")
    parser.add_argument("--num-replicas", default="1",
                        help="LLMReplica count (one per GPU), or 'auto'")
    parser.add_argument("--num-ingress-replicas", type=int, default=1)
    parser.add_argument("--router", choices=("kv-prefix", "kv", "pow2"), default="kv-prefix",
                        help="KV-aware router with or without prefix affinity, or Ray's default")
    parser.add_argument("--min-replicas", type=int, default=1, help="with --num-replicas auto")
    parser.add_argument("--max-replicas", type=int, default=4, help="with --num-replicas auto")
    parser.add_argument("--sim-cost-model", default=None,
                        help="simulated runner's cost model: a JSON file or inline JSON")
    parser.add_argument("--max-ongoing-requests", type=int, default=256,
                        help="Serve's per-replica in-flight bound")
    parser.add_argument("--num-gpus-per-replica", type=float, default=None,
                        help="default: 1 when the cluster has GPUs, else 0")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="request body limit (413 beyond it)")
    parser.add_argument("--drain-timeout-s", type=float, default=None)
    parser.add_argument("--address", default=None,
                        help="Ray address to join (e.g. auto, ray://head:10001); "
                             "default: start an embedded local Ray")
    parser.add_argument("--ray-num-cpus", type=int, default=None,
                        help="logical CPUs of the embedded Ray (default: max(2, cores))")
    parser.add_argument("--detach", action="store_true",
                        help="with --address: deploy and exit instead of staying attached")
    parser.add_argument("--simulate", action="store_true",
                        help="use the simulated runner (cost model, no GPU): --runner simulated")
    parser.add_argument("--runner", choices=("model", "simulated"), default=None)
    engine = parser.add_argument_group("engine (vLLM names; TensorRT-LLM aliases)")
    for flag in ENGINE_FLAGS:
        engine.add_argument(*flag.flags, dest=flag.dest, type=flag.type, choices=flag.choices,
                            default=None, help=flag.help or None)
    for flags, dest in ENGINE_BOOL_FLAGS:
        engine.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction,
                            default=None)
    return parser


def engine_kwargs_from(args: argparse.Namespace) -> dict[str, Any]:
    """Only the engine flags the user gave (EngineConfig keeps its defaults for the rest)."""
    dests = [f.dest for f in ENGINE_FLAGS] + [dest for _, dest in ENGINE_BOOL_FLAGS]
    kwargs = {d: getattr(args, d) for d in dests if getattr(args, d) is not None}
    runner = "simulated" if args.simulate else args.runner
    if runner is not None:
        kwargs["runner"] = runner
    return kwargs


def app_args_from(args: argparse.Namespace) -> dict[str, Any]:
    """The `AppArgs` dict for build_app (API keys are read here, passed as secrets)."""
    from iterserve.deploy.auth import load_api_keys

    app: dict[str, Any] = {
        "model": args.model,
        "engine_kwargs": engine_kwargs_from(args),
        "num_replicas": args.num_replicas,
        "num_ingress_replicas": args.num_ingress_replicas,
        "max_ongoing_requests": args.max_ongoing_requests,
        "api_keys": list(load_api_keys(args.api_key, args.api_key_file)),
        "router": args.router,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
    }
    if args.num_gpus_per_replica is not None:
        app["num_gpus_per_replica"] = args.num_gpus_per_replica
    if args.max_body_bytes is not None:
        app["max_body_bytes"] = args.max_body_bytes
    if args.drain_timeout_s is not None:
        app["drain_timeout_s"] = args.drain_timeout_s
    return app


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def start_ray(args: argparse.Namespace) -> str | None:
    """Join `--address`, or start an embedded Ray sized for this machine.

    Returns the metrics folder to remove at exit (embedded mode), else None.
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.num_replicas == "auto":
        from iterserve.autoscale.config import AutoscaleConfig
        from iterserve.autoscale.policy import autoscaling_env_vars

        # Serve reads its metric push intervals from the environment at start.
        os.environ.update(autoscaling_env_vars(AutoscaleConfig(
            min_replicas=args.min_replicas, max_replicas=args.max_replicas)))
    if args.sim_cost_model:
        os.environ["ITERSERVE_SIM_COST_MODEL"] = args.sim_cost_model  # replicas inherit it
    if args.address:
        ray.init(address=args.address, namespace="iterserve", log_to_driver=False)
        return None
    metrics_dir = tempfile.mkdtemp(prefix="iterserve-metrics-")
    try:
        from iterserve.dashboards.metrics import prepare_multiprocess_dir
    except ImportError:
        logger.warning("iterserve.dashboards.metrics unavailable; /metrics shows the ingress only")
    else:
        prepare_multiprocess_dir(metrics_dir)  # replicas inherit PROMETHEUS_MULTIPROC_DIR
    num_cpus = args.ray_num_cpus or max(2, os.cpu_count() or 2)
    ray.init(num_cpus=num_cpus, include_dashboard=False, namespace="iterserve",
             object_store_memory=256 * 1024**2, log_to_driver=False)
    return metrics_dir


def run(argv: list[str]) -> int:
    """Entry point of `iterserve serve`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from iterserve.deploy.app import APP_NAME, AppArgs, build_app

    try:
        app_args = AppArgs.model_validate(app_args_from(args))
        app_args.engine_config()
    except ValueError as error:
        print(f"iterserve serve: {error}", file=sys.stderr)
        return 2
    from ray import serve

    # Also SIGINT: a shell starting us in the background leaves it ignored (SIG_IGN).
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    embedded = args.address is None
    metrics_dir: str | None = None
    try:
        metrics_dir = start_ray(args)
        serve.start(http_options={"host": args.host, "port": args.port},
                    proxy_location="HeadOnly" if embedded else "EveryNode")
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        keys = f", {len(app_args.api_keys)} API key(s)" if app_args.api_keys else ""
        print(f"iterserve: ready at http://{host}:{args.port}/v1 "
              f"({app_args.num_replicas} replica(s){keys}); Ctrl-C to stop", flush=True)
        if args.detach and not embedded:
            return 0
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("iterserve: shutting down", flush=True)
    finally:
        _shutdown(embedded, APP_NAME, detached=args.detach and not embedded)
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _shutdown(embedded: bool, app_name: str, detached: bool) -> None:
    import ray
    from ray import serve

    if detached or not ray.is_initialized():
        return
    if embedded:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(app_name)
