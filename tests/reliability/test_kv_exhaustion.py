"""KV exhaustion: requests that together need far more KV than exists all finish with the
greedy outputs they give alone (preemption by recompute); a request that can never fit is a
400 at once, streaming or not, and is never left to hang.

The cache holds 16 blocks of 16 tokens (256 tokens); eight concurrent requests need about
8 x 7 = 56 blocks, so the scheduler must preempt and recompute repeatedly.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from reliability_support import is_openai_error, local_server, run_async, wait_replicas_idle

from iterserve.loadtests.studies.reliability.chaos import run_request

KV_ENGINE: dict[str, Any] = {
    "model": "iterserve-tiny",
    "device": "cpu",
    "max_model_len": 512,
    "num_gpu_blocks_override": 16,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "enable_prefix_caching": False,  # every block is computed, none shared
}
NUM_REQUESTS = 8
MAX_TOKENS = 90


def bodies() -> list[dict[str, Any]]:
    return [{"prompt": f"Story {i}: once upon a time there was a {'tiny ' * (i + 1)}engine",
             "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
             "stream": i % 2 == 1} for i in range(NUM_REQUESTS)]


async def alone_then_together(base_url: str) -> tuple[list[str], list[str], float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        alone = [await run_request(http, b) for b in bodies()]
        start = time.monotonic()
        together = await asyncio.gather(*[run_request(http, b) for b in bodies()])
        seconds = time.monotonic() - start
    for out in alone + list(together):
        assert out.ok and out.finish_reason == "length", (out.status, out.error)
    return [o.text for o in alone], [o.text for o in together], seconds


def never_fits(base_url: str) -> list[tuple[int, float, httpx.Response]]:
    """Prompt and max_tokens within the context (512) but beyond the whole cache (256)."""
    results = []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        warm = http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 1})
        assert warm.status_code == 200, warm.text  # loads the ingress's tokenizer first
        cases = [
            ("/v1/completions", {"prompt": "hello", "max_tokens": 400}),
            ("/v1/completions", {"prompt": "hello", "max_tokens": 400, "stream": True}),
            ("/v1/completions", {"prompt": list(range(1, 300)), "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 450, "stream": True}),
        ]
        for path, body in cases:
            start = time.monotonic()
            response = http.post(path, json=body)
            results.append((response.status_code, time.monotonic() - start, response))
    return results


def check_never_fits(results: list[tuple[int, float, httpx.Response]]) -> None:
    for status, seconds, response in results:
        assert status == 400 and is_openai_error(response), response.text[:300]
        assert "KV blocks" in response.json()["error"]["message"], response.text[:300]
        assert seconds < 2.0, f"rejection took {seconds:.2f}s"


def test_kv_exhaustion_in_process() -> None:
    with local_server(KV_ENGINE) as server:
        check_never_fits(never_fits(server.base_url))
        before = server.engine.stats().num_preemptions
        alone, together, seconds = run_async(alone_then_together(server.base_url), 600)
        preemptions = server.engine.stats().num_preemptions - before
        state = server.wait_idle()
    print("kv exhaustion (in process):", json.dumps({"requests": NUM_REQUESTS,
                                                     "preemptions": preemptions,
                                                     "together_s": round(seconds, 2)}))
    assert preemptions > 0, "the cache was never exhausted: the test proves nothing"
    assert together == alone
    assert state["num_free_blocks"] == state["num_total_blocks"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kv_exhaustion_serve(serve_session: Any) -> None:
    with serve_session.deploy({"engine_kwargs": KV_ENGINE}) as base_url:
        check_never_fits(never_fits(base_url))
        alone, together, seconds = run_async(alone_then_together(base_url), 600)
        stats = wait_replicas_idle(base_url)
    print("kv exhaustion (Serve):", json.dumps({"requests": NUM_REQUESTS,
                                                "preemptions": stats[0]["num_preemptions"],
                                                "together_s": round(seconds, 2)}))
    assert stats[0]["num_preemptions"] > 0
    assert together == alone
