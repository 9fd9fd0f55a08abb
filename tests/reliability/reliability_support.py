"""Shared machinery of the reliability tests (issue 7); conftest.py holds the fixture.

Two ways to stand the API up, both on 127.0.0.1 and a free port:

* `local_server(...)`: the SAME FastAPI app the Serve ingress builds (`create_app`) over
  `LocalEngineClient` and a real in-process `AsyncLLMEngine`, served by uvicorn in a thread.
  Real HTTP (so client disconnects are real socket closes), no Ray, and the engine's internals
  (block manager, scheduler, stream table) can be inspected after a run.
* `serve_session` (one per test session): a local Ray + Serve; `deploy(app_args)` runs
  `build_app(app_args)` (the production app: proxy -> OpenAIIngress -> LLMReplica) and removes
  it at the end. Ray starts once for every module that needs it.

Everything is bounded: request counts, timeouts, and every wait loop has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from iterserve.loadtests.servers import free_port, wait_until_ready

# Small real engines on CPU: the tiny random-weight model, short context, few KV blocks.
TINY_ENGINE: dict[str, Any] = {
    "model": "iterserve-tiny",
    "device": "cpu",
    "max_model_len": 128,
    "num_gpu_blocks_override": 64,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 8,
}
APP_NAME = "iterserve"


def is_openai_error(response: httpx.Response) -> bool:
    """True if the body is exactly OpenAI's error shape."""
    try:
        body = response.json()
    except ValueError:
        return False
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return False
    error = body["error"]
    return (set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and isinstance(error["type"], str))


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ('[DONE]' kept as a string)."""
    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[len("data:"):].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# --------------------------------------------------------------------- in-process server


@dataclass
class LocalServer:
    base_url: str
    engine: Any  # AsyncLLMEngine
    server: Any  # uvicorn.Server
    thread: threading.Thread
    log_records: list[str] = field(default_factory=list)

    def engine_call(self, fn: Any, timeout_s: float = 30) -> Any:
        """Run fn(LLMEngine) on the engine thread between steps; returns its result."""
        future = self.engine._submit(fn)  # the engine's own command queue (thread-safe)
        return future.result(timeout=timeout_s)

    def accounting(self) -> dict[str, Any]:
        """The engine's bookkeeping, read on its own thread (exact, not a stale snapshot)."""

        def read(engine: Any) -> dict[str, Any]:
            engine.block_manager.check_invariants()  # raises if free + used != total etc.
            manager = engine.block_manager
            return {
                "num_free_blocks": manager.num_free_blocks,
                "num_total_blocks": manager.num_total_blocks,
                "num_used_blocks": manager.num_used_blocks,
                "block_tables": len(manager.block_tables),
                "scheduler_requests": len(engine.scheduler.requests),
                "running": engine.scheduler.num_running,
                "waiting": engine.scheduler.num_waiting,
                "children": len(engine.children),
                "pending_children": len(engine.pending_children),
                "detokenizers": len(engine.detokenizers),
                "streams": len(self.engine._streams),
            }

        return self.engine_call(read)

    def wait_idle(self, timeout_s: float = 60) -> dict[str, Any]:
        """Poll until nothing is left behind: no request, no stream, no used KV block."""
        deadline = time.monotonic() + timeout_s
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            state = self.accounting()
            if is_idle(state):
                return state
            time.sleep(0.1)
        raise AssertionError(f"engine not idle after {timeout_s}s: {state}")


def is_idle(state: dict[str, Any]) -> bool:
    return (state["num_free_blocks"] == state["num_total_blocks"] and state["num_used_blocks"] == 0
            and all(state[k] == 0 for k in ("block_tables", "scheduler_requests", "running",
                                              "waiting", "children", "pending_children",
                                              "detokenizers", "streams")))


@contextlib.contextmanager
def local_server(engine_kwargs: dict[str, Any], api_keys: tuple[str, ...] = (),
                 max_body_bytes: int | None = None) -> Iterator[LocalServer]:
    """uvicorn (in a thread) serving create_app(LocalEngineClient(real engine))."""
    import uvicorn
    from pydantic import SecretStr

    from iterserve.deploy.engine_client import LocalEngineClient
    from iterserve.deploy.server import IngressSettings, create_app
    from iterserve.replica import AsyncLLMEngine, EngineConfig

    engine = AsyncLLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
    settings_kwargs: dict[str, Any] = {"api_keys": tuple(SecretStr(k) for k in api_keys)}
    if max_body_bytes is not None:
        settings_kwargs["max_body_bytes"] = max_body_bytes
    app = create_app(LocalEngineClient(engine), IngressSettings(**settings_kwargs))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=5, limit_concurrency=2000,
                            backlog=2048)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-reliability", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process uvicorn server did not start")
        time.sleep(0.05)
    try:
        yield LocalServer(f"http://127.0.0.1:{port}", engine, server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        engine.shutdown()


# ------------------------------------------------------------------------ Ray Serve


@dataclass
class ServeSession:
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @contextlib.contextmanager
    def deploy(self, app_args: dict[str, Any], ready_timeout_s: float = 180) -> Iterator[str]:
        """Run build_app(app_args) as the only application; yields the base URL."""
        from ray import serve

        from iterserve.deploy.app import build_app

        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
        keys = app_args.get("api_keys") or []
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else None
        try:
            wait_until_ready(self.base_url, timeout_s=ready_timeout_s, headers=headers)
            yield self.base_url
        finally:
            serve.delete(APP_NAME, _blocking=True)

    @staticmethod
    def logs_dir() -> Path:
        """This Ray session's log folder (every worker's stdout/stderr and Serve's logs)."""
        import ray

        node = ray._private.worker._global_node  # no public accessor in Ray 2.60
        return Path(node.get_logs_dir_path())


def replica_stats(base_url: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    response = httpx.get(f"{base_url}/debug/replicas", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return [info["stats"] | {"replica_id": info.get("replica_id"),
                             "num_cancelled": info.get("num_cancelled")}
            for info in response.json()["data"]]


def wait_replicas_idle(base_url: str, headers: dict[str, str] | None = None,
                       timeout_s: float = 60) -> list[dict[str, Any]]:
    """Poll /debug/replicas until every replica has no request and every KV block free."""
    deadline = time.monotonic() + timeout_s
    stats: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        stats = replica_stats(base_url, headers)
        if stats and all(s["num_running"] == 0 and s["num_waiting"] == 0
                         and s["num_free_blocks"] == s["num_total_blocks"]
                         and s["kv_usage"] == 0.0 for s in stats):
            return stats
        time.sleep(0.5)
    raise AssertionError(f"replicas not idle after {timeout_s}s: {stats}")


def run_async(coro: Any, timeout_s: float) -> Any:
    """Run a coroutine to completion with a hard deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# ----------------------------------------------------------------- simulated runners, PIDs

# The simulated GPU of the crash / overload / soak tests: 20 ms per step (instead of the
# default H100 6.5 ms), so that the Ray data path on a 2-core box is not the bottleneck.
# Creating SIM_FAULT_FILE makes the first simulated GPU to step fault (DeviceFaultError), which
# kills that replica's engine loop (tests/reliability/test_engine_loop_death.py).
SIM_FAULT_FILE = os.path.join(tempfile.gettempdir(), f"iterserve-sim-fault-{os.getpid()}")
SIM_COST = {"a_s": 0.02, "fault_trigger_file": SIM_FAULT_FILE}
SIM_ENGINE: dict[str, Any] = {
    "model": "iterserve-tiny",  # only its config and tokenizer are read
    "runner": "simulated",
    "simulator": json.dumps(SIM_COST),
    "max_model_len": 1024,
    "num_gpu_blocks_override": 256,
    "max_num_seqs": 8,
}


def serve_actor_pids(class_fragment: str) -> list[int]:
    """PIDs of this Ray session's live actors whose class name contains class_fragment
    (e.g. 'LLMReplica'); read from the GCS, so other Ray sessions on the box are never hit."""
    import ray

    return sorted(int(info["Pid"]) for info in ray._private.state.actors().values()
                  if class_fragment in info["ActorClassName"] and info["State"] == "ALIVE"
                  and info.get("Pid"))


def rss_mb(pids: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return out
