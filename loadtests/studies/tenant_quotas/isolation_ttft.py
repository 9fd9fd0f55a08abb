"""Does a second tenant's identical prompt cost what a cold prompt costs (no timing side
channel), and does a tenant's own repeat, or a shared-cache deployment's, cost less?

The real ingress app (`create_app`) over the real engine in this process, its runner the
calibrated cost model (`runner=simulated`, prefill priced 10x the default: 0.3 ms a token,
so a 1,600-token prefill is ~0.5 s and the difference stands far above HTTP and the shared
box's noise). Rounds alternate the cases on a fresh prompt each: tenant A cold, A again
(its own cache), tenant B with the same prompt (salted: must be cold), then the same with
`tenant_cache_isolation` off (B hits A's blocks). The latency of a `max_tokens: 1`
completion is its time to first token plus one response.

    python -m iterserve.loadtests.studies.tenant_quotas.isolation_ttft --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from fastapi.testclient import TestClient

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.deploy.tenant_file import parse_keys_file
from iterserve.replica import AsyncLLMEngine, EngineConfig

HERE = Path(__file__).resolve().parent
KEYS = "tenant a\ntenant b\nsk-a a\nsk-b b\n"
PROMPT_TOKENS = 1600


def timed(http: TestClient, key: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds, cached prompt tokens) of one max_tokens 1 completion."""
    start = time.perf_counter()
    response = http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"prompt": prompt, "max_tokens": 1})
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(response.text)
    return elapsed, response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every case")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "isolation_ttft.json",
                        help="where the figures are written")
    args = parser.parse_args(argv)
    config = EngineConfig.from_kwargs(
        model="iterserve-tiny", device="cpu", runner="simulated", max_model_len=2048,
        num_gpu_blocks_override=2048, simulator='{"b_s_per_prefill_token": 0.0003}')
    engine = AsyncLLMEngine(config)
    parsed = parse_keys_file(KEYS)
    apps = {isolation: create_app(LocalEngineClient(engine), IngressSettings(
        api_keys=parsed.keys, tenants=parsed.tenants, tenant_cache_isolation=isolation))
        for isolation in (True, False)}
    cases: dict[str, list[tuple[float, int]]] = {}
    try:
        with TestClient(apps[True]) as salted, TestClient(apps[False]) as shared:
            timed(salted, "sk-a", [7 + i % 90 for i in range(PROMPT_TOKENS)])  # warm-up
            for r in range(args.rounds):
                for isolation, http in (("on", salted), ("off", shared)):
                    # a fresh prompt every round and mode (distinct first blocks), in the
                    # tiny model's vocabulary (4,096)
                    offset = (r * 2 + (isolation == "off")) * 613 % 2500
                    prompt = [500 + offset + i % 500 for i in range(PROMPT_TOKENS)]
                    for name, key in (("A cold", "sk-a"), ("A again", "sk-a"),
                                      ("B same prompt", "sk-b")):
                        cases.setdefault(f"isolation {isolation}: {name}", []).append(
                            timed(http, key, prompt))
    finally:
        engine.shutdown()
    summary = {case: {"median_s": round(statistics.median(t for t, _ in runs), 4),
                      "cached_tokens": sorted({c for _, c in runs})}
               for case, runs in cases.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "prompt_tokens": PROMPT_TOKENS,
                                    "summary": summary, "runs": cases}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
