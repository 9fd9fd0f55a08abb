"""Start and stop local `iterserve serve` deployments for benchmarks and tests.

`serve_mode` runs `iterserve serve --batching MODE` on a free 127.0.0.1 port in its own
session, waits until GET /v1/models answers, and stops it with Ctrl-C (then the process
group it started, if it hangs).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for servers the tests and load scripts start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until_ready(url: str, process: subprocess.Popen[bytes] | None = None,
                     log_path: Path | None = None, api_key: str | None = None,
                     timeout_s: float = STARTUP_TIMEOUT_S,
                     headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Poll GET /v1/models until it lists a model (the engine replicas are up); returns the
    model card. A server `process` that exits first raises, with the tail of its log."""
    if headers is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/v1/models", headers=headers, timeout=5.0)
            if response.status_code == 200 and response.json().get("data"):
                return response.json()["data"][0]
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as error:
            last = type(error).__name__
        if process is not None and process.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"iterserve serve exited with {process.returncode}:\n{tail}")
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not ready within {timeout_s:.0f} s ({last})")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C first (serve shuts Ray down), then the process group it started in."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=15)


@contextmanager
def serve_mode(mode: str, serve_args: Sequence[str], log_dir: Path, api_key: str | None,
               extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """`iterserve serve --batching MODE` on a free port, stopped on exit."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"serve-{mode}.log"
    command = [sys.executable, "-m", "iterserve.deploy.cli", "serve", "--port", str(port),
               "--batching", mode, *serve_args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, **(extra_env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, wait_until_ready(url, process, log_path, api_key)
    finally:
        stop_server(process)
