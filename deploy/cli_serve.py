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
import sys
import tempfile
import typing
from typing import Any, Literal

from iterserve.autoscale.config import AutoscaleConfig
from iterserve.deploy.settings import AppArgs
from iterserve.deploy.shutdown import (
    DrainNow,
    DrainReport,
    StopNow,
    StopSignals,
    drain_app,
    exit_with_parent,
)
from iterserve.replica.config import engine_settings

logger = logging.getLogger("iterserve.serve")

# The AppArgs fields that are flags of `iterserve serve` (their type, default and help come
# from the field); the engine's flags come from EngineConfig's fields (`add_engine_flags`).
APP_FLAGS = ("model", "num_replicas", "router", "min_replicas", "max_replicas",
             "downscale_to_zero_delay_s", "startup_s", "max_ongoing_requests",
             "max_queued_requests", "hold_timeout_s", "num_gpus_per_replica", "num_cpus_per_replica",
             "num_ingress_replicas", "api_key_file", "tenant_cache_isolation", "max_body_bytes",
             "drain_timeout_s", "max_replicas_per_node", "metrics_prefix", "chat_template",
             "tool_call_parser", "kv_pull", "kv_pull_max_bytes", "kv_pull_timeout_s")
OBJECT_STORE_BYTES = 256 * 2**20  # the embedded Ray's default object store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve serve", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accepted Bearer key (repeatable; also env ITERSERVE_API_KEYS)")
    add_app_flags(parser.add_argument_group("deployment"))
    parser.add_argument("--address", default=None,
                        help="Ray address to join (e.g. auto, ray://head:10001); "
                             "default: start an embedded local Ray")
    parser.add_argument("--ray-num-cpus", type=int, default=None,
                        help="logical CPUs of the embedded Ray (default: max(2, cores))")
    parser.add_argument("--object-store-memory", type=int, default=OBJECT_STORE_BYTES,
                        metavar="BYTES",
                        help="bytes of the embedded Ray's object store (shared memory): prefix "
                             "pulls (--kv-pull) travel through it, so give it at least twice "
                             "--kv-pull-max-bytes")
    parser.add_argument("--detach", action="store_true",
                        help="with --address: deploy and exit instead of staying attached")
    parser.add_argument("--simulate", action="store_true",
                        help="use the simulated runner (cost model, no GPU): --runner simulated")
    add_engine_flags(parser.add_argument_group("engine (vLLM names; TensorRT-LLM aliases)"))
    return parser


def add_engine_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per EngineConfig setting, generated from its declaration (name, aliases,
    type, choices, help); a flag left out keeps the config's default."""
    for spec in engine_settings():
        flags = [f"--{name.replace('_', '-')}" for name in (spec.name, *spec.aliases)]
        shown = _help(spec.help, spec.default)
        if spec.type is bool:
            group.add_argument(*flags, dest=spec.name, action=argparse.BooleanOptionalAction,
                               default=None, help=shown)
        else:
            group.add_argument(*flags, dest=spec.name, type=spec.type, choices=spec.choices,
                               nargs="+" if spec.many else None, default=None, help=shown)


def _help(text: str, default: object) -> str:
    """The setting's help and its own default; the flag's argparse default stays None ("not
    given"), and "%(default).0s" (prints nothing) keeps the formatter from adding it."""
    shown = text if default is None else f"{text} (default: {default})"
    return shown + "%(default).0s"


def add_app_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per deployment setting of APP_FLAGS, generated from AppArgs' field."""
    for name in APP_FLAGS:
        info = AppArgs.model_fields[name]
        choices = typing.get_args(info.annotation) \
            if typing.get_origin(info.annotation) is Literal else None
        options = [t for t in typing.get_args(info.annotation) if t is not type(None)]
        kind = info.annotation if not options else options[0]
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=_help(info.description or "", info.default))
            continue
        kind = str if choices or kind not in (int, float) or name == "num_replicas" else kind
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, choices=choices,
                           default=None,
                           help=_help(info.description or "", info.default))


def engine_kwargs_from(args: argparse.Namespace) -> dict[str, Any]:
    """Only the engine flags the user gave (EngineConfig keeps its defaults for the rest)."""
    kwargs = {spec.name: ",".join(getattr(args, spec.name)) if spec.many
              else getattr(args, spec.name)
              for spec in engine_settings() if getattr(args, spec.name) is not None}
    if args.simulate:
        kwargs["runner"] = "simulated"
    return kwargs


def app_args_from(args: argparse.Namespace) -> dict[str, Any]:
    """The `AppArgs` dict for build_app. The flags' and env var's API keys are read here and
    passed as secrets; the keys file is parsed here too, so a malformed one stops start-up
    naming its line, and read again by each ingress (its keys carry their tenants)."""
    from iterserve.deploy.auth import load_api_keys

    app: dict[str, Any] = {name: getattr(args, name) for name in APP_FLAGS
                           if getattr(args, name) is not None}
    app["engine_kwargs"] = engine_kwargs_from(args)
    load_api_keys(args.api_key, args.api_key_file)  # raises ValueError naming the bad line
    app["api_keys"] = [key for key, _ in load_api_keys(args.api_key).keys]
    return app


def start_ray(args: argparse.Namespace, autoscale: AutoscaleConfig | None) -> str | None:
    """Join `--address`, or start an embedded Ray sized for this machine.

    Returns the metrics folder to remove at exit (embedded mode), else None.
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if autoscale is not None:
        from iterserve.autoscale.autoscaling_policy import autoscaling_env_vars

        # Serve reads its metric push intervals from the environment at start.
        os.environ.update(autoscaling_env_vars(autoscale))
    if args.address:
        ray.init(address=args.address, namespace="iterserve", log_to_driver=False)
        return None
    metrics_dir = tempfile.mkdtemp(prefix="iterserve-metrics-")
    # Imported here: prometheus_client must see the multiprocess folder before it starts.
    from iterserve.dashboards.metrics import prepare_multiprocess_dir

    prepare_multiprocess_dir(metrics_dir)  # replicas inherit PROMETHEUS_MULTIPROC_DIR
    num_cpus = args.ray_num_cpus or max(2, os.cpu_count() or 2)
    print(f"iterserve: starting Ray (embedded, {num_cpus} CPUs)", flush=True)
    # Our private cluster keeps Ray's default token auth; its notice that it is on is noise
    # on a newcomer's first screen.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
        logging.ERROR)
    # address="local": a fresh cluster of our own, never one a `ray start` left on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="iterserve",
             object_store_memory=args.object_store_memory, log_to_driver=False,
             logging_level=logging.WARNING)
    return metrics_dir


def run(argv: list[str]) -> int:
    """Entry point of `iterserve serve`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    for name in ("ray", "ray.serve"):  # a newcomer sees our lines, not Ray's start-up chatter
        logging.getLogger(name).setLevel(logging.WARNING)
    from iterserve.deploy.app import APP_NAME, build_app, resolve_app

    try:
        settings = resolve_app(app_args_from(args))
    except (ValueError, FileNotFoundError) as error:
        print(f"iterserve serve: {error}", file=sys.stderr)
        return 2
    if settings.args.kv_pull != "off" and args.address is None and (
            2 * settings.args.kv_pull_max_bytes > args.object_store_memory):
        print(f"iterserve serve: --kv-pull-max-bytes {settings.args.kv_pull_max_bytes} does not "
              f"fit twice in --object-store-memory {args.object_store_memory}: a pull's chunks "
              f"sit in the store while they are read", file=sys.stderr)
        return 2
    from ray import serve

    # Also SIGINT: a shell starting us in the background leaves it ignored (SIG_IGN).
    signals = StopSignals()
    signals.install()
    embedded = args.address is None
    detached = args.detach and not embedded
    metrics_dir: str | None = None
    report: DrainReport | None = None
    try:
        exit_with_parent()  # when a bench or a test started us (loadtests/servers.py)
        engine = settings.engine
        print(f"iterserve: model {engine.served_model_name} ({engine.model or 'built-in'}; "
              f"{engine.device}, {engine.dtype})", flush=True)
        metrics_dir = start_ray(args, settings.autoscale)
        signals.install()  # ray.init replaced them (deploy/shutdown.py says how)
        serve.start(http_options={"host": args.host, "port": args.port},
                    proxy_location="HeadOnly" if embedded else "EveryNode")
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # serve.start reset it
        try:
            signals.drainable = not detached
            serve.run(build_app(settings), name=APP_NAME, route_prefix="/", blocking=False)
            host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
            app_args = settings.args
            keys = f", {len(app_args.api_keys)} API key(s)" if app_args.api_keys else ""
            print(f"iterserve: ready at http://{host}:{args.port}/v1 serving "
                  f"{settings.engine.served_model_name} ({app_args.num_replicas} replica(s)"
                  f"{keys}); Ctrl-C or SIGTERM drains and stops", flush=True)
            if detached:
                return 0
            signals.wait()
        except DrainNow:  # a signal while serve.run deployed the app
            pass
        name = signals.received or "signal"
        report = drain_app(APP_NAME, settings.drain_timeout_s, name)
    except StopNow as stop:
        up = "" if signals.drainable else " (the server was not up yet)"
        print(f"iterserve: {stop}: stopping now{up}", flush=True)
    finally:
        if not detached:
            _shutdown(embedded, APP_NAME, signals, now=report is None)
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if report is not None:
        print(report.line(signals.received or "signal"), flush=True)
    return 0


def _shutdown(embedded: bool, app_name: str, signals: StopSignals, now: bool) -> None:
    """The embedded cluster ends with ray.shutdown, which stops its processes; after a drain
    nothing is in flight, and Serve's own shutdown first only added seconds and a "(raylet)
    Task ServeController.graceful_shutdown failed" line. On a cluster the app is deleted
    (`now`, or a signal during it: without waiting for its replicas to stop)."""
    import ray
    from ray import serve

    if not embedded and ray.is_initialized():
        try:
            serve.delete(app_name, _blocking=not now)
        except StopNow as stop:
            print(f"iterserve: {stop}: stopping now", flush=True)
    signals.ignore()  # a signal inside ray.shutdown would leave Ray's processes behind
    ray.shutdown()  # also ends the processes of a ray.init that a signal interrupted
