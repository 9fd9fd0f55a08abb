"""Is a tenant offered 3x its tokens-per-minute quota held to the quota, over HTTP, with two
ingress replicas? (README.md beside this file has the question, command and findings.)

Starts `iterserve serve` (tiny model, CPU, two ingress replicas, a keys file with one metered
tenant), sends the tenant an open-loop stream of completions at `--offered` times its quota
for `--duration` seconds, and reports what was admitted: in the steady state (after the first
refusal, once the bucket's one-minute allowance is spent) as a ratio of the quota, and over
the whole run against the bucket's bound (a minute's quota + the rate x the run); every
refusal's status and Retry-After; anything lost (an error or a request without an answer).

    python -m iterserve.loadtests.studies.tenant_quotas.measure --duration 90
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from iterserve.loadtests.servers import serve_mode

HERE = Path(__file__).resolve().parent
PROBE_KEY = "sk-quota-probe"
TENANT_KEY = "sk-quota-tenant"


@dataclass
class Outcome:
    sent_s: float  # seconds since the run began
    status: int  # 0: no answer (an exception or a timeout)
    tokens: int  # prompt + completion tokens served (admitted requests)
    retry_after: str | None
    remaining_tokens: str | None


async def one(client: httpx.AsyncClient, body: dict[str, Any], start: float) -> Outcome:
    sent = time.monotonic() - start
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError:
        return Outcome(sent, 0, 0, None, None)
    tokens = 0
    if response.status_code == 200:
        tokens = int(response.json()["usage"]["total_tokens"])
    return Outcome(sent, response.status_code, tokens, response.headers.get("Retry-After"),
                   response.headers.get("x-ratelimit-remaining-tokens"))


async def offer(url: str, tpm: int, offered: float, duration_s: float, prompt_tokens: int,
                max_tokens: int) -> list[Outcome]:
    per_request = prompt_tokens + max_tokens
    rate = offered * tpm / 60 / per_request  # requests a second, open loop
    body = {"prompt": list(range(100, 100 + prompt_tokens)), "max_tokens": max_tokens,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120,
                                 limits=limits) as client:
        start = time.monotonic()
        tasks = []
        for i in range(int(duration_s * rate)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(client, body, start)))
        return list(await asyncio.gather(*tasks))


def summarise(outcomes: list[Outcome], tpm: int, offered: float, duration_s: float
              ) -> dict[str, Any]:
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    lost = [o for o in outcomes if o.status not in (200, 429)]
    first_refusal = min((o.sent_s for o in refused), default=duration_s)
    steady = [o for o in admitted if o.sent_s >= first_refusal]
    steady_s = duration_s - first_refusal
    steady_rate = sum(o.tokens for o in steady) / steady_s * 60 if steady_s > 0 else 0.0
    total = sum(o.tokens for o in admitted)
    bound = tpm + tpm * duration_s / 60
    return {
        "tpm": tpm, "offered_x": offered, "duration_s": duration_s,
        "requests": len(outcomes), "admitted": len(admitted), "refused_429": len(refused),
        "lost": len(lost),
        "refusals_with_retry_after": sum(o.retry_after is not None for o in refused),
        "first_refusal_s": round(first_refusal, 2),
        "steady_window_s": round(steady_s, 1),
        "steady_tokens_per_min": round(steady_rate, 1),
        "steady_ratio_to_quota": round(steady_rate / tpm, 4),
        "run_tokens": total, "run_bound_tokens": round(bound),
        "run_ratio_to_bound": round(total / bound, 4),
        "offered_tokens_per_min": round(sum(
            (o.tokens or 0) for o in admitted) / max(len(admitted), 1)
            * len(outcomes) / duration_s * 60, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpm", type=int, default=6000, help="the tenant's tokens per minute")
    parser.add_argument("--offered", type=float, default=3.0,
                        help="offered load as a multiple of the quota")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of offered load")
    parser.add_argument("--prompt-tokens", type=int, default=20, help="prompt tokens a request")
    parser.add_argument("--max-tokens", type=int, default=20, help="generated tokens a request")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "tpm_3x.json",
                        help="where the summary and every outcome are written")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        keys = Path(scratch) / "keys"
        keys.write_text(f"tenant metered tokens_per_minute={args.tpm}\n"
                        f"{TENANT_KEY} metered\n{PROBE_KEY}\n")
        serve_args = ["--model", "iterserve-tiny", "--device", "cpu", "--num-ingress-replicas",
                      "2", "--api-key-file", str(keys), "--max-num-seqs", "32"]
        with serve_mode("continuous", serve_args, Path(scratch), PROBE_KEY) as (url, _):
            outcomes = asyncio.run(offer(url, args.tpm, args.offered, args.duration,
                                         args.prompt_tokens, args.max_tokens))
    summary = summarise(outcomes, args.tpm, args.offered, args.duration)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary,
                                    "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
