"""A stand-in OpenAI streaming server with known timings, for testing the load tools.

It answers POST /v1/completions (streamed or not), GET /health, /v1/models and /metrics with a
fixed time to first token and a fixed gap between tokens, so tests can check that Locust and
`bench` measure what they claim. It is not the iterserve server; `iterserve serve` is.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from iterserve.dashboards import metrics

MODEL = "fake-model"
KV_USAGE = metrics.metric_name(metrics.KV_CACHE_USAGE_PERC)
OUT_OF_BLOCKS = metrics.metric_name(metrics.NUM_OUT_OF_BLOCKS)


@dataclass
class FakeState:
    ttft_s: float
    itl_s: float
    capacity: int = 16  # "KV usage" = in-flight requests / capacity
    in_flight: int = 0
    completed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _chunk(text: str, index: int, finish: str | None = None) -> bytes:
    body = {"id": f"cmpl-{index}", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def _handler(state: FakeState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes

        def log_message(self, *args: Any) -> None:
            return

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                return self._send(200, b'{"status": "ok"}', "application/json")
            if self.path == "/v1/models":
                models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                return self._send(200, json.dumps(models).encode(), "application/json")
            if self.path == "/metrics":
                usage = state.in_flight / state.capacity
                labels = f'{{model_name="{MODEL}",replica="0"}}'
                text = (f"# TYPE {KV_USAGE} gauge\n{KV_USAGE}{labels} {usage}\n"
                        f"# TYPE {OUT_OF_BLOCKS} counter\n{OUT_OF_BLOCKS}{labels} 0.0\n")
                return self._send(200, text.encode(), "text/plain; version=0.0.4")
            return self._send(404, b"{}", "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            tokens = int(body.get("max_tokens", 16))
            with state.lock:
                state.in_flight += 1
            try:
                if body.get("stream"):
                    self._stream(tokens, body)
                else:
                    time.sleep(state.ttft_s + state.itl_s * (tokens - 1))
                    result = {"choices": [{"index": 0, "text": "x" * tokens,
                                           "finish_reason": "length"}],
                              "usage": {"completion_tokens": tokens}}
                    self._send(200, json.dumps(result).encode(), "application/json")
            finally:
                with state.lock:
                    state.in_flight -= 1
                    state.completed += 1

        def _stream(self, tokens: int, body: dict[str, Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.flush()  # headers go out before the first token, as with Starlette
            time.sleep(state.ttft_s)
            for index in range(tokens):
                if index:
                    time.sleep(state.itl_s)
                finish = "length" if index == tokens - 1 else None
                self.wfile.write(_chunk(" t", index, finish))
                self.wfile.flush()
            if (body.get("stream_options") or {}).get("include_usage"):
                prompt = body.get("prompt")
                usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 1,
                         "completion_tokens": tokens, "total_tokens": tokens}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                                 .encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


@contextmanager
def serve_fake_openai(ttft_s: float = 0.05, itl_s: float = 0.01,
                      capacity: int = 16) -> Iterator[tuple[str, FakeState]]:
    """Run the stand-in on 127.0.0.1 (a free port); yields (base URL, live state)."""
    state = FakeState(ttft_s, itl_s, capacity)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
