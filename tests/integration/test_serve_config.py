"""The ways to start iterserve, each as a real process on a free port, stopped with SIGINT:

* `serve run deploy/configs/local-cpu.yaml` (a copy with only the port changed) answers;
* `iterserve serve <engine flags>` passes every flag to the engine (read back from
  GET /v1/models metadata), and with --num-replicas 2 both replicas serve traffic.

One server at a time (each brings its own embedded Ray), so no module-wide app here.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


def test_serve_run_local_cpu_yaml(integration: Any, tmp_path: Path) -> None:
    config = yaml.safe_load((integration.REPO / "deploy/configs/local-cpu.yaml").read_text())
    port = integration.free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "local-cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    base_url = f"http://127.0.0.1:{port}"
    with integration.server_process([integration.python_bin("serve"), "run", str(path)],
                                    base_url, tmp_path / "serve-run.log") as proc:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": "hello"}])
        assert out.choices[0].finish_reason in ("stop", "length")
        meta = httpx.get(f"{base_url}/v1/models").json()["data"][0]["metadata"]
        assert meta["max_num_seqs"] == 32 and meta["max_waiting_requests"] == 64
        assert proc.poll() is None
    assert proc.returncode is not None


def test_cli_flags_reach_engine_and_two_replicas_serve(integration: Any, tmp_path: Path
                                                       ) -> None:
    port = integration.free_port()
    key = "sk-cli-test"
    argv = [sys.executable, "-m", "iterserve.deploy.cli", "serve", "--port", str(port),
            "--model", "iterserve-tiny",
            "--api-key", key, "--num-replicas", "2", "--ray-num-cpus", "4",
            "--num-gpus-per-replica", "0",  # CPU replicas even on a GPU machine
            "--max-batch-size", "3", "--max-num-batched-tokens", "384", "--block-size", "8",
            "--scheduler-policy", "priority", "--batching", "static", "--max-model-len", "384",
            "--num-gpu-blocks-override", "96", "--no-enable-chunked-prefill",
            "--max-waiting-requests", "7", "--seed", "11", "--served-model-name", "tiny",
            "--device", "cpu"]
    base_url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    with integration.server_process(argv, base_url, tmp_path / "iterserve.log", headers=auth):
        card = httpx.get(f"{base_url}/v1/models", headers=auth).json()["data"][0]
        assert card["id"] == "tiny" and card["max_model_len"] == 384
        meta = card["metadata"]
        expected = {"max_num_seqs": 3, "max_num_batched_tokens": 384, "block_size": 8,
                    "scheduler_policy": "priority", "batching": "static",
                    "num_gpu_blocks_override": 96, "num_gpu_blocks": 96,
                    "enable_chunked_prefill": False, "max_waiting_requests": 7, "seed": 11}
        assert {k: meta[k] for k in expected} == expected
        assert httpx.get(f"{base_url}/v1/models").status_code == 401

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120, headers=auth) as http:
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
                responses = await asyncio.gather(*(
                    http.post(f"{base_url}/v1/completions", json=body) for _ in range(6)))
                return [r.status_code for r in responses]

        served: dict[str, int] = {}
        for _ in range(5):  # power-of-two routing: a few bursts reach both replicas
            statuses = asyncio.run(burst())
            assert set(statuses) <= {200, 429}, statuses
            infos = httpx.get(f"{base_url}/debug/replicas", headers=auth).json()["data"]
            served = {i["replica_id"]: i["num_requests"] for i in infos}
            if len(served) == 2 and all(n > 0 for n in served.values()):
                break
        assert len(served) == 2 and all(n > 0 for n in served.values()), served
