"""Noisy neighbour over HTTP: tenant A sends 10x tenant B's rate, together above one replica's
capacity. What is B's p90 time to first token under the fair policy against FCFS, and
against a run where A sends only about its fair share? (README.md beside this file.)

Starts `iterserve serve --simulate` (one replica, the tiny model's tokenizer and config, the
runner the calibrated cost model with prefill priced ~7x, 0.2 ms a token, so the replica is
prefill-bound at ~9-10 requests a second of 512-token prompts), a keys file with tenants a
and b of equal weight, a with ttft_slo_ms (its excess is refused with 429 + Retry-After by
the SLO-aware admission rather than queued without bound); then opens open-loop streams of
completions for each tenant (fresh random prompts: no prefix-cache hits) and records every
request's status, TTFT (first streamed chunk) and Retry-After.

    python -m iterserve.loadtests.studies.fair_share.noisy_neighbour --policy fair
    python -m iterserve.loadtests.studies.fair_share.noisy_neighbour --policy fcfs
    python -m iterserve.loadtests.studies.fair_share.noisy_neighbour --policy fair --a-rate 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from iterserve.autoscale.percentile import percentile
from iterserve.loadtests.servers import serve_mode

HERE = Path(__file__).resolve().parent
PROBE_KEY = "sk-probe"
SIMULATOR = '{"b_s_per_prefill_token": 0.0002}'
PROMPT_TOKENS, MAX_TOKENS = 512, 8


@dataclass
class Outcome:
    tenant: str
    sent_s: float
    status: int  # 0: no answer (an exception or the harness's timeout)
    ttft_s: float | None
    tokens: int  # completion tokens served (the stream's usage chunk)
    retry_after: str | None


async def one(client: httpx.AsyncClient, tenant: str, prompt: list[int], start: float,
              timeout_s: float) -> Outcome:
    sent = time.monotonic()
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer sk-{tenant}"}
    ttft, tokens = None, 0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    return Outcome(tenant, sent - start, response.status_code, None, 0,
                                   response.headers.get("Retry-After"))
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if ttft is None:
                        ttft = time.monotonic() - sent
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, TimeoutError):
        return Outcome(tenant, sent - start, 0, ttft, tokens, None)
    return Outcome(tenant, sent - start, 200, ttft, tokens, None)


async def offer(url: str, rates: dict[str, float], duration_s: float, timeout_s: float
                ) -> list[Outcome]:
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()
        sends = sorted((i / rate, tenant) for tenant, rate in rates.items()
                       for i in range(int(duration_s * rate)))
        tasks = []
        for at, tenant in sends:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            prompt = [rng.randrange(100, 4000) for _ in range(PROMPT_TOKENS)]
            tasks.append(asyncio.ensure_future(one(client, tenant, prompt, start, timeout_s)))
        return list(await asyncio.gather(*tasks))


def summarise(outcomes: list[Outcome], duration_s: float, a_slo_s: float) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    served = {t: sum(1 for o in outcomes if o.tenant == t and o.status == 200)
              for t in ("a", "b")}
    for tenant in ("a", "b"):
        mine = [o for o in outcomes if o.tenant == tenant]
        ttfts = sorted(o.ttft_s for o in mine if o.status == 200 and o.ttft_s is not None)
        refused = [o for o in mine if o.status == 429]
        summary[tenant] = {
            "sent": len(mine), "served": served[tenant], "refused_429": len(refused),
            "refusals_with_retry_after": sum(o.retry_after is not None for o in refused),
            "lost": sum(o.status not in (200, 429) for o in mine),
            "short": sum(o.status == 200 and o.tokens != MAX_TOKENS for o in mine),
            "within_a_slo": round(sum(t <= a_slo_s for t in ttfts) / max(1, len(ttfts)), 3),
            "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
            "ttft_p90_s": round(percentile(ttfts, 90), 3) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None,
            "served_per_s": round(served[tenant] / duration_s, 2),
            "share_of_served": round(served[tenant] / max(1, sum(served.values())), 3),
        }
    return summary


def write_results(out: Path, summary: dict[str, Any], outcomes: list[Outcome]) -> None:
    """The summary, then one line per outcome (a row under `columns`): small and diffable."""
    rows = ",\n".join(json.dumps(list(asdict(o).values())) for o in outcomes)
    columns = json.dumps(list(Outcome.__dataclass_fields__))
    out.write_text(f'{{"summary": {json.dumps(summary, indent=1)},\n"columns": {columns},\n'
                   f'"outcomes": [\n{rows}\n]}}\n')


def add_scenario_flags(parser: argparse.ArgumentParser) -> None:
    """The noisy-neighbour scenario's flags, shared with its virtual-time replay."""
    parser.add_argument("--policy", default="fair", help="the engine's scheduler_policy")
    parser.add_argument("--a-rate", type=float, default=20.0, help="tenant a's requests/s")
    parser.add_argument("--b-rate", type=float, default=2.0, help="tenant b's requests/s")
    parser.add_argument("--a-slo-ms", type=float, default=2000.0, help="tenant a's ttft_slo_ms")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the engine's token budget a step (the step's length)")
    parser.add_argument("--duration", type=float, default=100.0, help="seconds of sending")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scenario_flags(parser)
    parser.add_argument("--timeout", type=float, default=60.0, help="a request's deadline (s)")
    parser.add_argument("--out", type=Path, default=None, help="results file (default: "
                        "results/<policy>_a<rate>.json)")
    args = parser.parse_args(argv)
    out = args.out or HERE / "results" / f"{args.policy}_a{args.a_rate:g}.json"
    with tempfile.TemporaryDirectory() as scratch:
        keys = Path(scratch) / "keys"
        keys.write_text(f"tenant a weight=1 ttft_slo_ms={args.a_slo_ms}\ntenant b weight=1\n"
                        f"sk-a a\nsk-b b\n{PROBE_KEY}\n")
        serve_args = ["--model", "iterserve-tiny", "--device", "cpu", "--simulate",
                      "--simulator", SIMULATOR, "--api-key-file", str(keys),
                      "--scheduler-policy", args.policy, "--max-num-seqs", "16",
                      "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--num-gpu-blocks-override", "4096", "--max-model-len", "1024"]
        with serve_mode("continuous", serve_args, Path(scratch), PROBE_KEY) as (url, _):
            began = time.monotonic()
            outcomes = asyncio.run(offer(url, {"a": args.a_rate, "b": args.b_rate},
                                         args.duration, args.timeout))
            wall = time.monotonic() - began
    summary = {"policy": args.policy, "max_num_batched_tokens": args.max_num_batched_tokens,
               "rates": {"a": args.a_rate, "b": args.b_rate},
               "a_slo_ms": args.a_slo_ms, "duration_s": args.duration,
               "wall_s": round(wall, 1), **summarise(outcomes, args.duration, args.a_slo_ms / 1000)}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, summary, outcomes)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
