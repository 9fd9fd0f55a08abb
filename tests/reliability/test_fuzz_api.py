"""Property-based fuzzing of /v1/completions and /v1/chat/completions (hypothesis).

Every answer must be a 2xx with a well-formed body or a 4xx in OpenAI's error shape: no 5xx,
ever. Afterwards the server answers /health, the engine holds no request and no KV block (its
block manager's invariants hold), and a greedy reference request gives the same text as
before the fuzzing.

Two targets, same strategies (fuzz_bodies.py):
* in process: create_app over LocalEngineClient and the real engine, under uvicorn;
* the real Serve application (proxy -> OpenAIIngress -> LLMReplica), marked ray.

Bodies go 8 at a time (CONCURRENCY), so hostile requests share engine steps with valid
ones: a request that kills the engine loop fails its batch mates too. Body counts:
FUZZ_BODIES (in process, default 10,000) and FUZZ_SERVE_BODIES (Serve, default 2,000); a
seed of 2**64 that killed the engine loop showed up 166-227 times in 10,000 bodies and never
in the first 2,000, so the defaults are what it takes. Each run writes its tally to
runs/reliability/fuzz_<target>.json (RELIABILITY_OUT overrides the folder).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fuzz_bodies import FuzzCase, FuzzTally, check_response, fuzz_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import (
    TINY_ENGINE,
    is_openai_error,
    local_server,
    wait_replicas_idle,
)

API_KEY = "sk-fuzz-0123456789abcdef"
BODY_LIMIT = 64 * 1024
FUZZ_BODIES = int(os.environ.get("FUZZ_BODIES", "10000"))
FUZZ_SERVE_BODIES = int(os.environ.get("FUZZ_SERVE_BODIES", "2000"))
CONCURRENCY = 8
DERANDOMIZE = os.environ.get("FUZZ_RANDOM", "0") != "1"  # CI: the same inputs every run
REFERENCE = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
             "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def out_dir() -> Path:
    path = Path(os.environ.get("RELIABILITY_OUT", "runs/reliability"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def send(http: httpx.Client, case: FuzzCase) -> httpx.Response:
    return http.post(case.path, content=case.body, headers=case.headers(API_KEY))


def fuzz(http: httpx.Client, num_bodies: int, tally: FuzzTally) -> None:
    """Send num_bodies hypothesis-drawn bodies, CONCURRENCY at a time; check every answer."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:

        @fuzz_settings(-(-num_bodies // CONCURRENCY))
        @given(cases=st.lists(fuzz_cases(), min_size=CONCURRENCY, max_size=CONCURRENCY))
        def run(cases: list[FuzzCase]) -> None:
            for case, response in zip(cases, pool.map(lambda c: send(http, c), cases),
                                      strict=True):
                check_response(case, response, tally)

        run()


def reference_text(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json=REFERENCE, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None,
                    derandomize=DERANDOMIZE, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def record(target: str, tally: FuzzTally, seconds: float, extra: dict[str, Any]) -> None:
    summary = {"target": target, "seconds": round(seconds, 1), **tally.summary(), **extra}
    (out_dir() / f"fuzz_{target}.json").write_text(json.dumps(summary, indent=2))
    print(f"fuzz {target}: {json.dumps(summary)}")


# ------------------------------------------------------------------------------ in process


@pytest.fixture(scope="module")
def local() -> Any:
    with local_server(TINY_ENGINE, api_keys=(API_KEY,), max_body_bytes=BODY_LIMIT) as server:
        yield server


def test_fuzz_in_process(local: Any) -> None:
    tally = FuzzTally()
    start = time.monotonic()
    with httpx.Client(base_url=local.base_url, timeout=120) as http:
        before = reference_text(http)
        fuzz(http, FUZZ_BODIES, tally)
        assert http.get("/health").status_code == 200
        state = local.wait_idle(timeout_s=60)
        assert reference_text(http) == before
    record("in_process", tally, time.monotonic() - start, {"engine_after": state})
    assert tally.num_inputs >= FUZZ_BODIES
    assert set(tally.statuses) & {400}, "the fuzzer never reached validation"
    assert 200 in tally.statuses, "the fuzzer never produced a valid request"


def check_oversized_bodies(base_url: str) -> None:
    """413 in OpenAI's shape with and without Content-Length (a chunked body)."""
    big = b'{"prompt": "' + b"a" * (BODY_LIMIT + 10) + b'"}'

    def chunks() -> Any:  # no Content-Length: the limit must hold while streaming the body
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    with httpx.Client(base_url=base_url, timeout=60, headers=AUTH) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            declared = http.post(path, content=big, headers={"Content-Type": "application/json"})
            streamed = http.post(path, content=chunks(), headers={"Content-Type": "application/json"})
            for response in (declared, streamed):
                assert response.status_code == 413, response.text[:200]
                assert is_openai_error(response)
        assert http.get("/health").status_code == 200


def test_oversized_bodies_are_413_in_process(local: Any) -> None:
    check_oversized_bodies(local.base_url)
    local.wait_idle()


# ------------------------------------------------------------------------------ Ray Serve


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_serve(serve_session: Any) -> None:
    app_args = {"engine_kwargs": dict(TINY_ENGINE), "api_keys": [API_KEY],
                "max_body_bytes": BODY_LIMIT}
    tally = FuzzTally()
    with serve_session.deploy(app_args) as base_url, \
            httpx.Client(base_url=base_url, timeout=120) as http:
        before = reference_text(http)
        start = time.monotonic()
        fuzz(http, FUZZ_SERVE_BODIES, tally)
        seconds = time.monotonic() - start
        check_oversized_bodies(base_url)
        assert http.get("/health").status_code == 200
        stats = wait_replicas_idle(base_url, AUTH)
        assert reference_text(http) == before
    record("serve", tally, seconds, {"replicas_after": stats})
    assert tally.num_inputs >= FUZZ_SERVE_BODIES
