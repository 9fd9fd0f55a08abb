"""Overload probe: measure capacity, then offer a multiple of it and account for every request.

    python -m iterserve.loadtests.studies.reliability.overload --url http://127.0.0.1:8000 --factor 3 \
        --duration 20 [--max-tokens 64] [--api-key KEY]

Phase 1 (capacity): `concurrency` closed-loop clients for `capacity_s` seconds; capacity is
completed requests per second. Phase 2 (overload): open-loop arrivals at factor x capacity
for `duration_s` seconds, each a non-streaming completion of exactly `max_tokens` tokens.
Every request ends as a success (200 with max_tokens tokens) or a 429 with Retry-After, or
it is reported under `unaccounted` (anything else: 5xx, transport error, timeout, short
output). Latencies of 429s and of admitted requests are reported as percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from iterserve.autoscale.percentile import percentile
from iterserve.loadtests.studies.reliability.chaos import Outcome, run_request


@dataclass
class OverloadResult:
    capacity_rps: float
    offered_rps: float
    sent: int
    succeeded: int
    rejected_429: int
    rejected_without_retry_after: int
    unaccounted: list[str]
    latency_429_s: dict[str, float | None]
    latency_ok_s: dict[str, float | None]
    service_time_s: float  # median latency at capacity (phase 1)
    seconds: float
    samples: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": round(percentile(values, q), 3) if values else None
            for q in (50, 90, 99, 100)}


def _body(prompt_index: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": f"overload request {prompt_index}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


async def measure_capacity(client: httpx.AsyncClient, headers: dict[str, str] | None,
                           concurrency: int, seconds: float, max_tokens: int
                           ) -> tuple[float, float]:
    """(completed requests per second, median latency) of a closed loop."""
    deadline = time.monotonic() + seconds
    latencies: list[float] = []
    counter = iter(range(10**6))

    async def worker() -> None:
        while time.monotonic() < deadline:
            out = await run_request(client, _body(next(counter), max_tokens), headers)
            if not out.ok:
                raise RuntimeError(f"capacity run failed: {out.status} {out.error}")
            latencies.append(out.latency_s)

    start = time.monotonic()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return len(latencies) / (time.monotonic() - start), statistics.median(latencies)


async def overload(base_url: str, headers: dict[str, str] | None = None, factor: float = 3.0,
                   duration_s: float = 20.0, max_tokens: int = 64, concurrency: int = 8,
                   capacity_s: float = 10.0, sampler: Any = None,
                   timeout_s: float = 120.0) -> OverloadResult:
    """`sampler()` (optional) is called about every 0.5 s; its dicts land in `samples`."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        capacity, service = await measure_capacity(client, headers, concurrency, capacity_s,
                                                   max_tokens)
        rate = capacity * factor
        num = int(rate * duration_s)
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()

        async def sample_loop() -> None:
            while not stop.is_set() and len(samples) < 10_000:
                if sampler is not None:
                    samples.append(await asyncio.to_thread(sampler))
                await asyncio.sleep(0.5)

        async def one(i: int) -> Outcome:
            await asyncio.sleep(i / rate)  # evenly spaced open-loop arrivals
            return await run_request(client, _body(10**6 + i, max_tokens), headers,
                                     timeout_s=timeout_s)

        sampling = asyncio.create_task(sample_loop())
        start = time.monotonic()
        outcomes = await asyncio.gather(*[one(i) for i in range(num)])
        seconds = time.monotonic() - start
        stop.set()
        await sampling
    ok = [o for o in outcomes if o.ok and o.finish_reason == "length"]
    rejected = [o for o in outcomes if o.status == 429]
    ok_ids = {id(o) for o in ok}
    unaccounted = [f"{o.status}: {o.error}" for o in outcomes
                   if id(o) not in ok_ids and o.status != 429]
    return OverloadResult(
        capacity_rps=round(capacity, 2), offered_rps=round(rate, 2), sent=num,
        succeeded=len(ok), rejected_429=len(rejected),
        rejected_without_retry_after=sum(1 for o in rejected if not o.retry_after),
        unaccounted=unaccounted[:20] + ([f"... {len(unaccounted)} in all"]
                                        if len(unaccounted) > 20 else []),
        latency_429_s=_pcts([o.latency_s for o in rejected]),
        latency_ok_s=_pcts([o.latency_s for o in ok]), service_time_s=round(service, 3),
        seconds=round(seconds, 2), samples=samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iterserve.loadtests.studies.reliability.overload",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--api-key", default="", help="Bearer key, if the server wants one")
    parser.add_argument("--factor", type=float, default=3.0,
                        help="offer this multiple of the measured capacity")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of overload")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request asks for")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="closed-loop clients that measure the capacity")
    parser.add_argument("--capacity-seconds", type=float, default=10.0,
                        help="seconds the capacity is measured for")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    result = asyncio.run(overload(args.url, headers, args.factor, args.duration, args.max_tokens,
                                  args.concurrency, args.capacity_seconds))
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if not result.unaccounted else 1


if __name__ == "__main__":
    sys.exit(main())
