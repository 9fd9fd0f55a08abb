"""Scale from zero on real Ray Serve, over HTTP, with the official openai client: an app with
min_replicas 0 starts with no LLMReplica; the model card, /tokenize, /detokenize,
/debug/replicas and /health answer at once and start none; 32 requests arriving over 2 s
start one and are all served (none fails, none hangs); with the hold timeout below the
replica's start-up, every held request gets a 503 with Retry-After at the deadline.

One Ray cluster for the module; two apps on it in turn (the second with a 1 s hold). The
engine is the tiny random-weight model on CPU (conftest SMALL_ENGINE).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from iterserve.autoscale.autoscaling_policy import autoscaling_env_vars
from iterserve.autoscale.config import AutoscaleConfig
from iterserve.autoscale.percentile import percentile

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(480)]

NUM_REQUESTS = 32
ARRIVALS_OVER_S = 2.0
HELD_REQUESTS = 8
SHORT_HOLD_S = 1.0


@pytest.fixture(scope="module")
def cluster(integration: Any) -> Iterator[int]:
    from ray import serve

    from iterserve.loadtests.servers import interrupt_on_termination

    # Serve reads the metric push intervals at start: the handles report queued requests
    # every 0.5 s (Serve's default, 10 s, would delay the scale from zero by that much).
    os.environ.update(autoscaling_env_vars(AutoscaleConfig()))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    port = integration.free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024**2, namespace=f"iterserve-zero-{port}")
    interrupt_on_termination()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    proxy_location="HeadOnly")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(integration: Any, port: int, hold_timeout_s: float) -> str:
    """The app with min_replicas 0 (none started), ready once its ingress is."""
    from ray import serve

    from iterserve.deploy.app import APP_NAME, build_app
    from iterserve.loadtests.servers import wait_until_ready

    if APP_NAME in serve.status().applications:
        serve.delete(APP_NAME)
    app = build_app({"engine_kwargs": integration.SMALL_ENGINE, "num_gpus_per_replica": 0,
                     "num_replicas": "auto", "min_replicas": 0, "max_replicas": 1,
                     "hold_timeout_s": hold_timeout_s})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    base_url = f"http://127.0.0.1:{port}"
    wait_until_ready(base_url, timeout_s=120)
    assert replica_count() == 0
    return base_url


def replica_count() -> int:
    """LLMReplica replicas in any state (starting included)."""
    from ray import serve

    from iterserve.deploy.app import APP_NAME

    app = serve.status().applications.get(APP_NAME)
    deployment = app.deployments.get("LLMReplica") if app else None
    return sum(deployment.replica_states.values()) if deployment else 0


def running_replicas() -> int:
    from ray import serve

    from iterserve.deploy.app import APP_NAME

    deployment = serve.status().applications[APP_NAME].deployments["LLMReplica"]
    return int(deployment.replica_states.get("RUNNING", 0))


@pytest.fixture(scope="module")
def base_url(integration: Any, cluster: int) -> str:
    return deploy(integration, cluster, hold_timeout_s=300.0)


def test_model_probes_at_zero_answer_at_once_and_start_no_replica(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                           timeout=10)
    started = time.monotonic()
    models = client.models.list().data
    took = time.monotonic() - started
    assert len(models) == 1 and took < 1.0, took
    model = models[0].id
    with httpx.Client(base_url=base_url, timeout=10) as http:
        tokens = http.post("/tokenize", json={"model": model, "prompt": "hello there"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        text = http.post("/detokenize", json={"model": model, "tokens": tokens["tokens"]})
        assert text.status_code == 200 and "hello" in text.json()["prompt"]
        assert http.get(f"/v1/models/{model}").status_code == 200
        assert http.get("/debug/replicas").json()["data"] == []
        assert http.get("/health").json() == {"status": "ok"}  # requests are held, not refused
        assert http.get("/live").status_code == 200
    time.sleep(3.0)  # several metric pushes and autoscaler ticks: none starts a replica
    assert replica_count() == 0


def test_32_requests_from_zero_all_served(base_url: str) -> None:
    ready_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # when the first replica is RUNNING
        while not stop.is_set():
            if running_replicas() > 0:
                ready_at.append(time.monotonic())
                return
            time.sleep(0.1)

    async def one(client: openai.AsyncOpenAI, i: int, model: str) -> dict[str, Any]:
        await asyncio.sleep(i * ARRIVALS_OVER_S / (NUM_REQUESTS - 1))
        record: dict[str, Any] = {"sent": time.monotonic(), "first": None, "done": None}
        stream = await client.completions.create(model=model, prompt=f"request {i}",
                                                 max_tokens=8, stream=True)
        async for chunk in stream:
            if record["first"] is None and chunk.choices and chunk.choices[0].text:
                record["first"] = time.monotonic()
        record["done"] = time.monotonic()
        return record

    async def burst() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                    max_retries=0, timeout=150)
        model = (await client.models.list()).data[0].id
        return await asyncio.wait_for(asyncio.gather(
            *(one(client, i, model) for i in range(NUM_REQUESTS)), return_exceptions=True),
            timeout=200)  # a hung request fails the test here

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(burst())
    finally:
        stop.set()
        watcher.join(timeout=5)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    first_sent = min(r["sent"] for r in results)
    ttfts = sorted(r["first"] - r["sent"] for r in results)
    assert all(r["first"] is not None and r["done"] is not None for r in results)
    assert ready_at, "no replica became RUNNING"
    # the replica reports its start, stage by stage, on this node's monotonic clock
    startup = httpx.get(f"{base_url}/debug/replicas", timeout=10).json()["data"][0]["startup"]
    assert {"imports", "weights_place", "kv_cache"} <= set(startup["stages"])
    assert first_sent < startup["started_at"] < startup["ready_at"] < min(
        r["first"] for r in results)
    print(f"\nscale from zero: {NUM_REQUESTS} requests over {ARRIVALS_OVER_S:.0f} s, 0 failed; "
          f"first request to a RUNNING replica {ready_at[0] - first_sent:.1f} s; first-token "
          f"time min {ttfts[0]:.1f} s, p50 {percentile(ttfts, 50):.1f} s, max {ttfts[-1]:.1f} s"
          f"; load average {os.getloadavg()[0]:.1f}")


def test_requests_held_past_the_deadline_get_503_with_retry_after(
        integration: Any, cluster: int, base_url: str) -> None:
    """Start-up (actor, imports, model) takes longer than the 1 s hold: every request gets
    its 503 about a second after it was sent, with Retry-After, and none hangs."""
    url = deploy(integration, cluster, hold_timeout_s=SHORT_HOLD_S)

    async def one(client: openai.AsyncOpenAI, i: int, model: str) -> tuple[float, Any]:
        sent = time.monotonic()
        try:
            await client.chat.completions.create(
                model=model, max_tokens=4, messages=[{"role": "user", "content": f"hi {i}"}],
                stream=i % 2 == 0)
        except openai.APIStatusError as error:
            return time.monotonic() - sent, error
        return time.monotonic() - sent, None

    async def held() -> list[tuple[float, Any]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=30)
        model = (await client.models.list()).data[0].id
        return await asyncio.wait_for(
            asyncio.gather(*(one(client, i, model) for i in range(HELD_REQUESTS))), timeout=60)

    results = asyncio.run(held())
    for waited, error in results:
        assert error is not None, "served within the hold: start-up was not past it"
        assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
        assert SHORT_HOLD_S <= waited < SHORT_HOLD_S + 3.0, waited
    print(f"\nheld past {SHORT_HOLD_S:.0f} s: {len(results)} x 503 after "
          f"{min(w for w, _ in results):.2f}-{max(w for w, _ in results):.2f} s")

