"""Steady streaming load with a timeline, for disruption experiments (issue 14 part 3):
node loss (`node_loss.py`), scale-down and rolling redeploy (`serve_deploy_disruption.py`,
tests/reliability/test_planned_disruption.py).

`StreamingLoad` runs closed-loop streaming clients in a thread of its own (so the test's
thread can block in `serve.run` / kill a node meanwhile) and keeps every request's `Outcome`;
`Timeline` records named events in seconds since the load started, for RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from iterserve.loadtests.studies.reliability.chaos import Outcome, run_request


@dataclass
class Timeline:
    start: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, event: str) -> float:
        at = round(time.monotonic() - self.start, 2)
        self.events.append((at, event))
        print(f"[{at:7.2f} s] {event}", flush=True)
        return at

    def dump(self) -> str:
        return json.dumps(self.events)


class StreamingLoad:
    """`clients` closed-loop streams of `max_tokens` tokens (ignore_eos) until stopped."""

    def __init__(self, url: str, clients: int, max_tokens: int, timeout_s: float = 180) -> None:
        self.url = url
        self.clients = clients
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        sent = 0
        while not self._stop.is_set():
            sent += 1
            body = {"prompt": f"client {index} request {sent}: a story",
                    "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True}
            self.outcomes.append(await run_request(client, body, timeout_s=self.timeout_s))

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.clients + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s,
                                     limits=limits) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.clients)))

    def __enter__(self) -> StreamingLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop_sending(self) -> None:
        """Send no new request; the ones in flight go on (`stop` waits for them)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop sending; wait for the requests in flight (bounded by their timeout)."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 30)

    def completed(self) -> int:
        return sum(1 for o in self.outcomes if self.is_complete(o))

    def is_complete(self, outcome: Outcome) -> bool:
        """200, [DONE], no error event, and every token asked for (finish_reason length)."""
        return outcome.ok and outcome.done and outcome.finish_reason == "length"

    def failures(self) -> list[dict[str, Any]]:
        return [{"status": o.status, "error": o.error, "finish_reason": o.finish_reason,
                 "chunks": o.num_chunks, "started": round(o.started, 2),
                 "latency_s": round(o.latency_s, 2)}
                for o in self.outcomes if not self.is_complete(o)]
