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
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server_info(url: str, api_key: str | None) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or not response.json().get("data"):
        return None
    return response.json()["data"][0]


def wait_until_ready(url: str, process: subprocess.Popen[bytes] | None, log_path: Path | None,
                     api_key: str | None, timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = _server_info(url, api_key)
        if info is not None:
            return info
        if process is not None and process.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"iterserve serve exited with {process.returncode}:\n{tail}")
        time.sleep(1.0)
    raise TimeoutError(f"{url} was not ready within {timeout_s:.0f} s")


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
