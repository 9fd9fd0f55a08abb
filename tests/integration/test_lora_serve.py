"""LoRA through the live stack with two replicas: the `openai` client -> Serve proxy ->
OpenAIIngress x2 -> KVAwareRouter -> LLMReplica x2 (real engines, tiny model, CPU). Proves what
only Serve can: a runtime load is broadcast to every replica, requests naming the adapter are
served by whichever replica takes them with the same tokens, the replicas report the adapter
in their routing stats, and an unload reaches them all; the load is recorded in the
application's registry (a named Ray actor), so whichever ingress takes a request knows it,
ingresses started in place of killed ones do too, and so does a registry actor started in
place of a killed one.

Run under the shared lock: flock /tmp/iterserve-heavy.lock .venv/bin/python -m pytest ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from iterserve.replica.make_model import default_model_path

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [11, 42, 97, 300, 5, 8, 13]


@pytest.fixture(scope="module")
def served(integration: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from tests.unit.lora_testlib import make_adapter

    root = tmp_path_factory.mktemp("lora_root")
    make_adapter(default_model_path(), root / "sql", ["q_proj", "v_proj", "down_proj"], seed=1)
    app_args = {"engine_kwargs": {**integration.SMALL_ENGINE, "enable_lora": True,
                                  "max_lora_rank": 8, "runtime_lora_root": str(root)},
                "num_gpus_per_replica": 0, "num_replicas": 2, "num_ingress_replicas": 2}
    with integration.serve_app(app_args, num_cpus=6) as url:
        yield url, root


def test_runtime_adapter_reaches_every_replica(served: tuple[str, Path]) -> None:
    url, root = served
    http = httpx.Client(base_url=url, timeout=120)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "sql"})
    assert loaded.status_code == 200, loaded.text
    replicas = http.get("/debug/replicas").json()["data"]
    assert len(replicas) == 2
    assert all(r["stats"].get("lora_adapters") == ["sql"] for r in replicas)
    texts = {client.completions.create(model="sql", prompt=PROMPT, max_tokens=8,
                                       temperature=0).choices[0].text for _ in range(6)}
    base = client.models.list().data[0].id
    base_text = client.completions.create(model=base, prompt=PROMPT, max_tokens=8,
                                          temperature=0).choices[0].text
    assert len(texts) == 1 and texts != {base_text}  # the same adapter tokens everywhere
    assert [m.id for m in client.models.list().data] == [base, "sql"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    assert all("lora_adapters" not in r["stats"]
               for r in http.get("/debug/replicas").json()["data"])
    with pytest.raises(openai.NotFoundError, match="sql"):
        client.completions.create(model="sql", prompt=PROMPT, max_tokens=4)


def serve_actor_pids(class_fragment: str) -> list[int]:
    """PIDs of this Ray session's live actors of that class (reliability_support's)."""
    import ray

    return sorted(int(info["Pid"]) for info in ray._private.state.actors().values()
                  if class_fragment in info["ActorClassName"] and info["State"] == "ALIVE"
                  and info.get("Pid"))


def test_replicas_started_after_a_load_serve_the_adapter(served: tuple[str, Path]) -> None:
    """Both replicas killed after a runtime load: the two Serve starts in their place never
    saw the load, and a request for the adapter is served there with the same tokens, read
    from the folder the ingress's registry sends with it (Serve starts a replacement as it
    starts one the autoscaler adds)."""
    import os
    import signal
    import time

    url, _ = served
    http = httpx.Client(base_url=url, timeout=120)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert http.post("/v1/load_lora_adapter",
                     json={"lora_name": "late", "lora_path": "sql"}).status_code == 200
    before = client.completions.create(model="late", prompt=PROMPT, max_tokens=8,
                                       temperature=0).choices[0].text
    old = serve_actor_pids("LLMReplica")
    assert len(old) == 2
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        new = serve_actor_pids("LLMReplica")
        stats = http.get("/debug/replicas").json()["data"] if len(new) == 2 and not set(
            new) & set(old) else []
        if len(stats) == 2 and all(r.get("stats") for r in stats):
            break
        time.sleep(1)
    else:
        raise AssertionError("the killed replicas were not replaced in 240 s")
    assert all("late" not in r["stats"].get("lora_adapters", ()) for r in stats)
    after = client.completions.create(model="late", prompt=PROMPT, max_tokens=8,
                                      temperature=0).choices[0].text
    assert after == before
    holders = [r for r in http.get("/debug/replicas").json()["data"]
               if "late" in r["stats"].get("lora_adapters", ())]
    assert len(holders) == 1  # the new replica that took the request read it
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200


def test_every_ingress_serves_a_load_and_restarted_ingresses_keep_it(
        served: tuple[str, Path]) -> None:
    """A load through one ingress (the proxy picks it) is listed and served by every
    answer the proxy gives (12 rounds over two ingresses: each answers some with odds
    1 - 2**-11; without the registry about half were 404s); both ingresses killed, the two
    Serve starts in their place never saw the load and still list and serve it; an unload
    through one of them is then seen by every answer."""
    import os
    import signal
    import time

    url, _ = served
    http = httpx.Client(base_url=url, timeout=120)
    body = {"model": "shared", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    assert http.post("/v1/load_lora_adapter",
                     json={"lora_name": "shared", "lora_path": "sql"}).status_code == 200

    def rounds() -> tuple[set[bool], set[int], set[str]]:
        listed, codes, texts = set(), set(), set()
        for _ in range(12):
            listed.add("shared" in [m["id"] for m in http.get("/v1/models").json()["data"]])
            answer = http.post("/v1/completions", json=body)
            codes.add(answer.status_code)
            if answer.status_code == 200:
                texts.add(answer.json()["choices"][0]["text"])
        return listed, codes, texts

    listed, codes, before = rounds()
    assert (listed, codes, len(before)) == ({True}, {200}, 1)
    old = serve_actor_pids("OpenAIIngress")
    assert len(old) == 2
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        new = serve_actor_pids("OpenAIIngress")
        if len(new) == 2 and not set(new) & set(old):
            try:
                if http.get("/v1/models", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # the proxy still routes to a killed ingress: asked again below
        time.sleep(1)
    else:
        raise AssertionError("the killed ingresses were not replaced in 180 s")
    listed, codes, after = rounds()
    assert (listed, codes, after) == ({True}, {200}, before)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "shared"}).status_code == 200
    listed, codes, _ = rounds()
    assert (listed, codes) == ({False}, {404})


def test_a_killed_registry_actor_comes_back_with_the_adapters_loaded(
        served: tuple[str, Path]) -> None:
    """The registry actor killed after a load: the next ingress read finds a new, empty
    actor and restores what it last read into it, so every answer still lists and serves the
    adapter with the same tokens, and an unload through the new actor reaches every answer."""
    import time

    import ray

    url, _ = served
    http = httpx.Client(base_url=url, timeout=120)
    body = {"model": "kept", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    assert http.post("/v1/load_lora_adapter",
                     json={"lora_name": "kept", "lora_path": "sql"}).status_code == 200
    before = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    time.sleep(1.5)  # every ingress's snapshot (at most 1 s old) has read the load
    for _ in range(4):  # both ingresses read the registry: each now remembers "kept"
        http.get("/v1/models")
    [registry] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("iterserve-lora-adapters:")]
    ray.kill(ray.get_actor(registry["name"], namespace=registry["namespace"]), no_restart=True)
    # Until the new actor's process has started, a read is a 503 with Retry-After (the
    # registry's timeout): never a 404 or a 500, and never the adapter served unchecked.
    deadline, recovery, answered = time.monotonic() + 120, set(), 0
    while time.monotonic() < deadline and answered < 6:  # both ingresses found the new one
        models = http.get("/v1/models")
        recovery.add(models.status_code)
        answered = answered + 1 if models.status_code == 200 else 0
        if models.status_code != 200:
            assert models.headers.get("retry-after"), models.text
            time.sleep(1)
    assert recovery <= {200, 503} and answered == 6, recovery
    codes, texts, listed = set(), set(), set()
    for _ in range(12):
        models = http.get("/v1/models")
        codes.add(models.status_code)
        if models.status_code == 200:
            listed.add("kept" in [m["id"] for m in models.json()["data"]])
        answer = http.post("/v1/completions", json=body)
        codes.add(answer.status_code)
        if answer.status_code == 200:
            texts.add(answer.json()["choices"][0]["text"])
    assert (codes, listed, texts) == ({200}, {True}, {before})
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "kept"}).status_code == 200
    assert all("kept" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
               for _ in range(8))
