"""Chaos drivers for an OpenAI-compatible server: disconnect storms and accounted load.

    python -m iterserve.loadtests.studies.reliability.chaos disconnect --url http://127.0.0.1:8000 \
        --cancelled 200 --normal 24 [--api-key KEY] [--seed 0]

`disconnect_storm` first runs the normal requests alone (greedy, the reference), then runs
them again while `cancelled` streaming requests are dropped at random points: before the
headers, after k chunks, or after a random delay. It reports whether the normal traffic gave
the reference outputs. The caller checks the server's accounting afterwards (no request and
no KV block left behind), which needs access the HTTP API does not give.

`run_request` is the one request primitive the reliability tests share: it never raises for
HTTP or transport failures; every request ends as an `Outcome` (a status, or a transport
error, or an in-stream error event), so a test can account for every request it sent.

Traffic goes only to the URL given (meant for 127.0.0.1); every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"


@dataclass
class Outcome:
    """How one request ended. `ok`: HTTP 200 and, for streams, [DONE] without an error."""

    status: int | None = None  # None: no HTTP status (transport error or cancelled)
    text: str = ""
    error: str | None = None
    finish_reason: str | None = None
    retry_after: str | None = None
    num_chunks: int = 0
    started: float = 0.0
    first_byte: float | None = None
    ended: float = 0.0
    done: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


async def run_request(client: httpx.AsyncClient, body: dict[str, Any],
                      headers: dict[str, str] | None = None, path: str = COMPLETIONS,
                      stop_after_chunks: int | None = None, timeout_s: float = 120.0
                      ) -> Outcome:
    """Send one completion request (streaming or not) and classify how it ended.

    stop_after_chunks: drop the connection after that many SSE chunks (a client disconnect).
    """
    out = Outcome(started=time.monotonic())

    async def send() -> None:
        if body.get("stream"):
            await _stream(client, path, body, headers, out, stop_after_chunks)
        else:
            response = await client.post(path, json=body, headers=headers)
            out.status = response.status_code
            out.retry_after = response.headers.get("retry-after")
            out.first_byte = time.monotonic()
            _read_json(response, out)

    try:
        await asyncio.wait_for(send(), timeout_s)
    except asyncio.TimeoutError:
        out.error = f"client timeout after {timeout_s}s"
    except httpx.HTTPError as error:
        out.error = f"{type(error).__name__}: {error}"
    out.ended = time.monotonic()
    return out


async def closed_loop_streams(client: httpx.AsyncClient, num_clients: int, run_s: float,
                              max_tokens: int, timeout_s: float
                              ) -> list[tuple[float, Outcome]]:
    """num_clients clients, each sending greedy streaming completions back to back for run_s
    seconds; returns (start offset in s, outcome) per request, in completion order."""
    outcomes: list[tuple[float, Outcome]] = []
    start = time.monotonic()

    async def one_client(i: int) -> None:
        n = 0
        while time.monotonic() - start < run_s:
            body = {"prompt": f"client {i} request {n}", "max_tokens": max_tokens,
                    "stream": True, "temperature": 0, "ignore_eos": True}
            offset = time.monotonic() - start
            outcomes.append((offset, await run_request(client, body, timeout_s=timeout_s)))
            n += 1

    await asyncio.gather(*[one_client(i) for i in range(num_clients)])
    return outcomes


def _read_json(response: httpx.Response, out: Outcome) -> None:
    try:
        payload = response.json()
    except ValueError:
        out.error = f"non-JSON body: {response.text[:200]!r}"
        return
    if response.status_code != 200:
        out.error = str(payload.get("error", payload)) if isinstance(payload, dict) else str(payload)
        return
    choice = payload["choices"][0]
    out.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    out.finish_reason = choice.get("finish_reason")
    out.done = True


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                  headers: dict[str, str] | None, out: Outcome,
                  stop_after_chunks: int | None) -> None:
    async with client.stream("POST", path, json=body, headers=headers) as response:
        out.status = response.status_code
        out.retry_after = response.headers.get("retry-after")
        out.first_byte = time.monotonic()
        if response.status_code != 200:
            await response.aread()
            _read_json(response, out)
            return
        if stop_after_chunks == 0:
            return  # disconnect right after the headers
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                out.done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                out.error = str(chunk["error"])
                continue
            out.num_chunks += 1
            for choice in chunk.get("choices") or ():
                out.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if stop_after_chunks is not None and out.num_chunks >= stop_after_chunks:
                return  # leaving the block closes the connection mid-stream
    if not out.done and out.error is None:
        out.error = "stream ended without [DONE]"


# ------------------------------------------------------------------------ disconnect storm


def normal_bodies(num: int, max_tokens: int = 24) -> list[dict[str, Any]]:
    """Greedy requests with distinct prompts; half of them stream."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    bodies = []
    for i in range(num):
        prompt = f"Request {i}: " + " ".join(words[(i + j) % len(words)] for j in range(3 + i % 5))
        bodies.append({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": i % 2 == 0})
    return bodies


@dataclass
class StormResult:
    num_cancelled_sent: int
    num_normal: int
    cancel_modes: dict[str, int]
    normal_mismatches: list[int]  # indices whose output differed from the reference
    normal_failures: list[str]
    cancelled_statuses: dict[str, int]
    seconds: float
    reference_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.normal_mismatches and not self.normal_failures

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


async def disconnect_storm(base_url: str, headers: dict[str, str] | None = None,
                           num_cancelled: int = 200, num_normal: int = 24, seed: int = 0,
                           spread_s: float = 4.0, max_cancel_tokens: int = 80,
                           timeout_s: float = 300.0) -> StormResult:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=num_cancelled + num_normal + 16,
                          max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        bodies = normal_bodies(num_normal)
        start = time.monotonic()
        reference = [await run_request(client, {**b, "stream": False}, headers) for b in bodies]
        reference_seconds = time.monotonic() - start
        bad = [f"reference {i}: {r.status} {r.error}" for i, r in enumerate(reference) if not r.ok]
        if bad:
            raise RuntimeError(f"the reference run failed: {bad[:3]}")

        modes: dict[str, int] = {}

        async def cancelled(i: int) -> Outcome:
            await asyncio.sleep(rng.uniform(0, spread_s))
            body = {"prompt": f"storm {i} " + "x " * rng.randint(1, 20), "stream": True,
                    "max_tokens": rng.randint(16, max_cancel_tokens), "ignore_eos": True,
                    "temperature": rng.choice([0.0, 0.8])}
            mode = rng.choice(["headers", "chunks", "chunks", "timer"])
            modes[mode] = modes.get(mode, 0) + 1
            if mode == "timer":  # cancel the task at a random time, wherever it is
                task = asyncio.ensure_future(run_request(client, body, headers))
                await asyncio.sleep(rng.uniform(0.0, 2.0))
                task.cancel()
                try:
                    return await task
                except asyncio.CancelledError:
                    return Outcome(error="cancelled")
            stop = 0 if mode == "headers" else rng.randint(1, 12)
            return await run_request(client, body, headers, stop_after_chunks=stop)

        async def normal(i: int) -> Outcome:
            await asyncio.sleep(rng.uniform(0, spread_s))
            return await run_request(client, bodies[i], headers)

        start = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*[cancelled(i) for i in range(num_cancelled)],
                           *[normal(i) for i in range(num_normal)]), timeout_s)
        seconds = time.monotonic() - start
    storm, normals = results[:num_cancelled], results[num_cancelled:]
    statuses: dict[str, int] = {}
    for out in storm:
        key = str(out.status)
        statuses[key] = statuses.get(key, 0) + 1
    failures = [f"normal {i}: status={o.status} error={o.error}" for i, o in enumerate(normals)
                if not o.ok or o.finish_reason != "length"]
    mismatches = [i for i, (o, r) in enumerate(zip(normals, reference, strict=True))
                  if o.ok and o.text != r.text]
    return StormResult(num_cancelled, num_normal, modes, mismatches, failures, statuses,
                       round(seconds, 2), round(reference_seconds, 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iterserve.loadtests.studies.reliability.chaos",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    storm = sub.add_parser("disconnect", help="disconnect storm with reference comparison")
    storm.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    storm.add_argument("--api-key", default="", help="Bearer key, if the server wants one")
    storm.add_argument("--cancelled", type=int, default=200,
                       help="streaming requests dropped at random points")
    storm.add_argument("--normal", type=int, default=24,
                       help="requests that run to the end, checked against a reference run")
    storm.add_argument("--seed", type=int, default=0, help="seed of the drop points")
    storm.add_argument("--timeout", type=float, default=600.0,
                       help="seconds a request may take before it counts as hung")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    result = asyncio.run(disconnect_storm(args.url, headers, args.cancelled, args.normal,
                                          args.seed, timeout_s=args.timeout))
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
