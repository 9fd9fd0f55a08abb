"""Helpers for integration tests that run the real Serve application on a local Ray.

Each test module starts at most ONE Serve application (a module-scoped fixture) on a free
port, on 127.0.0.1 only, and shuts Serve and Ray down at the end. The engine is the real one
with the built-in tiny model on CPU, sized small (few KV blocks, short context) so a module
stays within a minute or two on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from iterserve.loadtests.servers import (
    free_port,
    interrupt_on_termination,
    server_env,
    terminate_as_interrupt,
    wait_until_ready,
)

REPO = Path(__file__).resolve().parents[2]

# Small engines: the tiny random-weight model (named: the default is the real SmolLM2),
# a 512-token context, 128 KV blocks of 16 tokens, CPU.
SMALL_ENGINE: dict[str, Any] = {
    "model": "iterserve-tiny",
    "max_model_len": 512,
    "num_gpu_blocks_override": 128,
    "max_num_batched_tokens": 512,
    "device": "cpu",
}


@contextlib.contextmanager
def serve_app(app_args: dict[str, Any], num_cpus: int = 4) -> Iterator[str]:
    """Embedded Ray + Serve running build_app(app_args); yields the base URL."""
    import ray
    from ray import serve

    from iterserve.deploy.app import APP_NAME, build_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():  # a previous module left its cluster up: start clean
        serve.shutdown()
        ray.shutdown()
    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024**2, namespace=f"iterserve-test-{port}")
    interrupt_on_termination()  # a SIGTERM to pytest still shuts this cluster down
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    proxy_location="HeadOnly")
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
        base_url = f"http://127.0.0.1:{port}"
        keys = app_args.get("api_keys") or []
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else None
        wait_until_ready(base_url, timeout_s=180, headers=headers)
        yield base_url
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def server_process(argv: list[str], base_url: str, log_path: Path, timeout_s: float = 240,
                   env: dict[str, str] | None = None,
                   headers: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run a server command (iterserve serve / serve run) until ready; stop it with SIGINT.

    Its output goes to `log_path` (shown if it fails to come up). It ends with pytest, even
    when pytest is killed (loadtests/servers.py).
    """
    full_env = server_env({"RAY_USAGE_STATS_ENABLED": "0", **(env or {})})
    log = open(log_path, "w+")  # closed in the finally below
    with terminate_as_interrupt():  # a SIGTERM to pytest stops the server too
        proc = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                wait_until_ready(base_url, proc, timeout_s=timeout_s, headers=headers)
            except (TimeoutError, RuntimeError):
                log.seek(0)
                pytest.fail(f"server did not come up; its log:\n{log.read()[-4000:]}")
            yield proc
        finally:
            _stop(proc)
            log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # SIGINT: the same path as Ctrl-C
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and its children
            proc.wait(timeout=10)


def python_bin(name: str) -> str:
    """A console script of this venv (serve, iterserve)."""
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="session")
def integration() -> SimpleNamespace:
    """The helpers above, for test modules (conftest modules are not imported directly)."""
    return SimpleNamespace(SMALL_ENGINE=SMALL_ENGINE, serve_app=serve_app,
                           server_process=server_process, free_port=free_port,
                           python_bin=python_bin, REPO=REPO)
