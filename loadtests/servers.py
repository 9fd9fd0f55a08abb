"""Start and stop local `iterserve serve` deployments for benchmarks and tests.

`serve_mode` runs `iterserve serve --batching MODE` on a free 127.0.0.1 port in its own
session, waits until GET /health says it is ready, and stops it with Ctrl-C (then the
process group it started, if it hangs).

A server started here ends with the process that started it, however that ends: SIGTERM
or SIGHUP become `Terminated` (a KeyboardInterrupt) in the starter while it holds a server
(`terminate_as_interrupt`), so its `finally` stops the server as Ctrl-C does; and the
server itself asks the kernel for SIGTERM when its parent dies (`server_env`, honoured by
`iterserve serve`), which covers a SIGKILL or the OOM killer. Before this, `timeout`
(SIGTERM) on `iterserve bench` left both servers and their Ray clusters running: ~11 GiB
for half an hour with a 4 GiB CPU KV cache each.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import httpx

from iterserve.deploy.shutdown import EXIT_WITH_PARENT_ENV

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
T = TypeVar("T")


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that
    `finally` blocks and context managers run (pytest, too, stops and tears down on it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def interrupt_on_termination() -> None:
    """From now on SIGTERM and SIGHUP raise Terminated in the main thread (where a default
    handler would end the process at once). Call it after `ray.init` in a process that
    embeds Ray: ray.init installs a C handler that aborts on SIGTERM, leaving Ray's agents
    running (deploy/shutdown.py); Ray's atexit hook then shuts the cluster down."""
    if threading.current_thread() is threading.main_thread():
        for signum in TERMINATING_SIGNALS:
            signal.signal(signum, _raise_terminated)


async def until_terminated(awaitable: Awaitable[T]) -> T:
    """`await awaitable`, turning SIGTERM or SIGHUP into Terminated raised here. Inside a
    running event loop the plain handler raises in whatever task the signal interrupts:
    that task ends with the exception, asyncio prints "Task exception was never retrieved"
    and its traceback, and the awaiting code sees it late or not at all. Here the loop takes
    the signal, cancels this task (and so what it awaits) and raises Terminated once they
    are cancelled; the previous handlers are back at the end."""
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if this is not None:
            this.cancel()

    previous = {signum: signal.getsignal(signum) for signum in TERMINATING_SIGNALS}
    for signum in TERMINATING_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if received:
            raise Terminated(received[0]) from None
        raise
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            signal.signal(signum, handler)


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """`interrupt_on_termination` while inside, where the handlers were the defaults; the
    previous handlers are back at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in TERMINATING_SIGNALS}
    for signum, handler in previous.items():
        if handler == signal.SIG_DFL:
            signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler == signal.SIG_DFL:
                signal.signal(signum, handler)


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a server started here: this one, `extra`, and this process's pid,
    which `iterserve serve` reads to end with it (deploy/shutdown.py: exit_with_parent)."""
    return {**os.environ, **(extra or {}), EXIT_WITH_PARENT_ENV: str(os.getpid())}


# Ports handed out here lie below the kernel's ephemeral range and above Ray's worker ports
# (10002-19999 by default): a port the kernel picked for us (bind to 0) is one it may hand to
# any of Ray's many sockets in the seconds before our server binds it (a test once failed
# "Failed to bind 127.0.0.1:41311" so), while nothing binds ports in this band unasked.
PORT_BAND_LOW = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for servers the tests and load scripts start), chosen
    at random below the ephemeral range (PORT_BAND_LOW up); an ephemeral one where that band
    is empty or no port in it is free."""
    try:
        band_high = int(_EPHEMERAL_RANGE.read_text().split()[0]) - 1
    except (OSError, ValueError, IndexError):
        band_high = PORT_BAND_LOW - 1  # not Linux: no band
    chooser = random.SystemRandom()
    for _ in range(64 if band_high > PORT_BAND_LOW else 0):
        port = chooser.randint(PORT_BAND_LOW, band_high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until_ready(url: str, process: subprocess.Popen[bytes] | None = None,
                     log_path: Path | None = None, api_key: str | None = None,
                     timeout_s: float = STARTUP_TIMEOUT_S,
                     headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Poll GET /health until the server is ready (a model replica answered, or the app
    scales to zero and holds requests while one starts), then return the model card of
    GET /v1/models (which the ingress answers itself, replica or not). A server `process`
    that exits first raises, with the tail of its log."""
    if headers is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                response = httpx.get(f"{url}/v1/models", headers=headers, timeout=5.0)
                if response.status_code == 200 and response.json().get("data"):
                    return response.json()["data"][0]
            last = "not ready"
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
    with terminate_as_interrupt():
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, env=server_env(extra_env))
        url = f"http://127.0.0.1:{port}"
        try:
            yield url, wait_until_ready(url, process, log_path, api_key)
        finally:
            stop_server(process)
