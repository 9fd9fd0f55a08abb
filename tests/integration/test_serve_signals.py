"""`iterserve serve` stopped as a container runtime stops it: SIGTERM to the process alone.

Each test starts a real `iterserve serve` (the tiny model, embedded Ray) in its own session
and signals its pid only, as `docker stop`, Kubernetes and systemd do:

* /health's first 200 means a request is served at once; 16 live streams at SIGTERM all
  finish, while /health is 503 (load balancers drain), /live 200 and a new request a 503;
  the process exits 0 with one line saying what it drained and nothing that reads as a
  crash, and no process of its Ray cluster is left;
* with a drain timeout shorter than the streams, each ends with the documented error;
* idle, SIGTERM stops at once; a second signal during a drain stops without waiting;
* /health is 503 and /live 200 while no model replica can answer yet (one that cannot be
  scheduled), and SIGTERM then stops the server cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from proctools import wait_until_gone

from iterserve.loadtests.servers import free_port, wait_until_ready

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
NUM_STREAMS = 16
CRASH_TEXT = ("SIGTERM received at time", "*** ", "Traceback", "PC: @", "(raylet)")
EXIT_TIMEOUT_S = 90


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=120)


def start(tmp_path: Path, *flags: str, ready: bool = True) -> Server:
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "iterserve.deploy.cli", "serve", "--port", str(port),
            "--model", "iterserve-tiny", "--device", "cpu", "--max-model-len", "512",
            "--num-gpu-blocks-override", "512", "--ray-num-cpus", "2", *flags]
    with open(log, "wb") as out:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                                start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    if ready:
        try:
            wait_until_ready(server.url, proc, log, timeout_s=240)
        except (TimeoutError, RuntimeError):
            stop(server)
            raise
    return server


def stop(server: Server) -> None:
    """The end of every test: the process and its whole session gone (SIGKILL if it hangs,
    after which the test has failed already)."""
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)


def assert_clean_exit(server: Server) -> str:
    code = server.proc.wait(timeout=EXIT_TIMEOUT_S)
    output = server.output()
    assert code == 0, output
    assert not [text for text in CRASH_TEXT if text in output], output
    assert wait_until_gone(server.proc.pid) == []
    return output


@dataclass
class Streams:
    """NUM_STREAMS chat streams in threads; `started` once each has its first chunk."""

    server: Server
    max_tokens: int
    started: threading.Barrier = field(init=False)
    results: dict[int, Any] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = threading.Barrier(NUM_STREAMS + 1, timeout=120)
        client = self.server.client()
        model = client.models.list().data[0].id
        for i in range(NUM_STREAMS):
            thread = threading.Thread(target=self._run, args=(i, client, model), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.started.wait()

    def _run(self, i: int, client: openai.OpenAI, model: str) -> None:
        finish, tokens, waited = None, 0, False
        try:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"stream {i}"}],
                max_tokens=self.max_tokens, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True})
            for chunk in stream:
                if not waited:
                    waited = True
                    self.started.wait()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            self.results[i] = (finish, tokens)
        except openai.APIError as error:
            self.results[i] = ("error", error.message)
        except httpx.HTTPError as error:  # a cut connection (a second signal)
            self.results[i] = ("cut", repr(error))

    def join(self) -> dict[int, Any]:
        for thread in self.threads:
            thread.join(timeout=EXIT_TIMEOUT_S)
        return self.results


def wait_for_health(server: Server) -> None:
    """Poll /health from launch; its first 200 must mean a request is served at once."""
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=10).status_code == 200:
                break
        except httpx.HTTPError:
            pass  # not listening yet
        assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
        time.sleep(0.2)
    client = server.client().with_options(timeout=10)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="hello",
                                    max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_sigterm_drains_16_live_streams(tmp_path: Path) -> None:
    server = start(tmp_path, ready=False)
    try:
        wait_for_health(server)
        streams = Streams(server, max_tokens=256)
        os.kill(server.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 while draining"
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "draining"}
        assert httpx.get(f"{server.url}/live", timeout=10).status_code == 200
        with pytest.raises(openai.InternalServerError) as refused:
            server.client().completions.create(model="any", prompt="x", max_tokens=2)
        assert refused.value.status_code == 503 and "shutting down" in refused.value.message
        assert streams.join() == {i: ("length", 256) for i in range(NUM_STREAMS)}
        output = assert_clean_exit(server)
        assert f"SIGTERM: drained {NUM_STREAMS} request(s)" in output
        assert f"{NUM_STREAMS} finished; stopped" in output
    finally:
        stop(server)


def test_sigterm_drain_timeout_ends_streams_with_an_error(tmp_path: Path) -> None:
    server = start(tmp_path, "--drain-timeout-s", "1")
    try:
        streams = Streams(server, max_tokens=480)
        os.kill(server.proc.pid, signal.SIGTERM)
        results = streams.join()
        assert len(results) == NUM_STREAMS
        for finish, message in results.values():
            assert finish == "error" and "drain timeout (1 s) ended it" in message
        output = assert_clean_exit(server)
        assert f"{NUM_STREAMS} ended with a 503 error at the drain timeout (1 s)" in output
    finally:
        stop(server)


def test_sigterm_idle_stops_at_once(tmp_path: Path) -> None:
    server = start(tmp_path)
    try:
        signalled = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        output = assert_clean_exit(server)
        assert "SIGTERM: no request in flight; stopped" in output
        print(f"idle SIGTERM to exit: {time.monotonic() - signalled:.1f} s")
    finally:
        stop(server)


def test_a_second_signal_stops_without_draining(tmp_path: Path) -> None:
    server = start(tmp_path)
    try:
        streams = Streams(server, max_tokens=480)
        os.kill(server.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while "draining" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.1)
        os.kill(server.proc.pid, signal.SIGINT)
        signalled = time.monotonic()
        output = assert_clean_exit(server)
        print(f"second signal to exit: {time.monotonic() - signalled:.1f} s")
        assert "SIGINT: stopping now" in output and "finished" not in output
        assert len(streams.join()) == NUM_STREAMS
        assert all(result[0] != "length" for result in streams.results.values())
    finally:
        stop(server)


def test_health_is_503_until_a_model_replica_answers(tmp_path: Path) -> None:
    # A replica that asks for more CPUs than the embedded Ray has never starts: the ingress
    # is up with no model replica behind it, for as long as the test looks.
    server = start(tmp_path, "--num-cpus-per-replica", "3", ready=False)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                live = httpx.get(f"{server.url}/live", timeout=10).status_code
            except httpx.HTTPError:
                live = None
            if live == 200:
                break
            assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
            time.sleep(0.5)
        for _ in range(5):
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert (health.status_code, health.json()) == (503, {"status": "loading"})
            time.sleep(0.5)
        os.kill(server.proc.pid, signal.SIGTERM)
        output = assert_clean_exit(server)
        assert "SIGTERM: no request in flight; stopped" in output
    finally:
        stop(server)
