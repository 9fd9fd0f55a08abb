"""Security: API keys never logged or echoed; constant-time comparison; size limits before
tokenising.

* Every log record of a run (root logger at DEBUG, uvicorn's access log included) and every
  response body is searched for the configured key and for a wrong key a client sent; in the
  Serve test, every file of the Ray session's log folder is searched too.
* ApiKeyChecker compares a token with EVERY configured key through hmac.compare_digest (no
  early exit on a match, no `==`).
* An oversized body is refused (413) without the tokenizer being called; a prompt that cannot
  fit the context whatever its tokenisation must be refused before it is tokenised, and must
  not stall the event loop (see test_huge_prompt_rejected_before_tokenising).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from reliability_support import TINY_ENGINE, is_openai_error, local_server, wait_replicas_idle

from iterserve.deploy.app import AppArgs
from iterserve.deploy.auth import ApiKeyChecker, load_api_keys
from iterserve.deploy.server import IngressSettings

API_KEY = "sk-SECRET-e3b0c44298fc1c149afbf4c8996fb924"
WRONG_KEY = "sk-WRONGKEY-27ae41e4649b934ca495991b7852b855"
OTHER_KEY = "sk-OTHER-d7a8fbb307d7809469ca9abcb0082e4f"
SECRETS = (API_KEY, WRONG_KEY, OTHER_KEY, "e3b0c44298fc1c149afbf4c8996fb924",
           "27ae41e4649b934ca495991b7852b855")
BODY_LIMIT = 16 * 1024


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception as error:  # noqa: BLE001 - a record that cannot format is kept raw
            line = f"{record.msg!r} {record.args!r} ({error!r})"
        with self._lock:
            self.lines.append(line)


@pytest.fixture
def captured_logs() -> Iterator[_Capture]:
    handler = _Capture()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    names = ("uvicorn", "uvicorn.access", "uvicorn.error", "httpx", "httpcore", "fastapi")
    saved = {n: (logging.getLogger(n).level, logging.getLogger(n).propagate) for n in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.DEBUG)
        logging.getLogger(name).propagate = True
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        for name, (level, propagate) in saved.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).propagate = propagate


def exercise(base_url: str) -> list[httpx.Response]:
    """Requests with the right key, a wrong key, a malformed header, bad bodies, a stream."""
    good = {"Authorization": f"Bearer {API_KEY}"}
    responses = []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
        responses.append(http.post("/v1/completions", json=body, headers=good))
        responses.append(http.post("/v1/completions", json={**body, "stream": True}, headers=good))
        responses.append(http.post("/v1/chat/completions", headers=good, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        for header in (f"Bearer {WRONG_KEY}", WRONG_KEY, f"Basic {WRONG_KEY}",
                       f"Bearer {API_KEY}x", f"bearer {API_KEY[:-1]}", f"Bearer  {WRONG_KEY}"):
            responses.append(http.post("/v1/completions", json=body,
                                       headers={"Authorization": header}))
        responses.append(http.get("/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}))
        # a key smuggled into fields that are echoed or logged on error paths
        responses.append(http.post("/v1/completions", headers=good,
                                   json={"prompt": "x", "max_tokens": WRONG_KEY}))
        responses.append(http.post("/v1/completions", headers=good,
                                   json={"prompt": "x", "model": WRONG_KEY}))
        responses.append(http.post("/v1/completions", headers=good, content=b"{" + WRONG_KEY.encode()))
    assert responses[0].status_code == 200, responses[0].text
    assert responses[1].status_code == 200
    assert responses[2].status_code == 200
    for response in responses[3:10]:
        assert response.status_code == 401, response.text
        assert is_openai_error(response)
    return responses


def leaked(texts: list[str], secrets: tuple[str, ...] = SECRETS) -> list[str]:
    return [f"{secret!r} in {text[:200]!r}" for text in texts for secret in secrets
            if secret in text]


def test_keys_never_logged_or_echoed_in_process(captured_logs: _Capture) -> None:
    with local_server(TINY_ENGINE, api_keys=(API_KEY, OTHER_KEY)) as server:
        responses = exercise(server.base_url)
        server.wait_idle()
    assert len(captured_logs.lines) > 5, "the capture saw nothing: the test would prove nothing"
    bodies = [r.text for r in responses[:2]] + [r.text for r in responses[3:]]
    header_values = [str(dict(r.headers)) for r in responses]
    # The echo check must skip the user's own smuggled value in 400 bodies (it is the user's
    # input, not a configured key): only 401s and 404s must not name any key.
    auth_errors = [r.text for r in responses[3:10]] + header_values
    assert not leaked(auth_errors), leaked(auth_errors)
    assert not leaked(captured_logs.lines), leaked(captured_logs.lines)
    assert not leaked(bodies, (API_KEY, OTHER_KEY))


def test_reprs_and_dumps_hide_keys() -> None:
    keys = load_api_keys([API_KEY], env={"ITERSERVE_API_KEYS": OTHER_KEY})
    settings = IngressSettings(api_keys=keys.keys, tenants=keys.tenants)
    args = AppArgs.model_validate({"api_keys": [API_KEY, OTHER_KEY]})
    texts = [repr(keys), str(keys), repr(settings), repr(ApiKeyChecker(keys.keys)), repr(args),
             str(args), args.model_dump_json(), str(args.model_dump())]
    assert not leaked(texts), leaked(texts)


def test_key_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = [SecretStr(f"sk-key-{i}") for i in range(4)]
    checker = ApiKeyChecker(keys)
    for token, expected in (("sk-key-0", True), ("sk-key-3", True), ("sk-nope", False)):
        calls.clear()
        assert (checker.tenant_of(f"Bearer {token}") is not None) is expected
        assert len(calls) == len(keys), "must compare with every key: no early exit"
        assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
    calls.clear()
    assert all(checker.tenant_of(refused) is None for refused in (None, "", "Bearer "))


def test_body_limit_enforced_before_tokenising() -> None:
    with local_server(TINY_ENGINE, max_body_bytes=BODY_LIMIT) as server:
        tokenizer = server.engine.tokenizer
        calls = []
        original = tokenizer.encode

        def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
            calls.append(len(text))
            return original(text, *args, **kwargs)

        tokenizer.encode = counting
        try:
            with httpx.Client(base_url=server.base_url, timeout=60) as http:
                prompt = "word " * (BODY_LIMIT // 4)
                for path, body in (("/v1/completions", {"prompt": prompt}),
                                   ("/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": prompt}]})):
                    response = http.post(path, json=body)
                    assert response.status_code == 413 and is_openai_error(response)
            assert calls == [], f"the tokenizer ran on an oversized body: {calls}"
        finally:
            del tokenizer.encode  # back to the class attribute
        server.wait_idle()


@pytest.mark.slow
def test_huge_prompt_rejected_before_tokenising() -> None:
    """A prompt whose character count alone proves it cannot fit the context is a 400 at
    once, and the server keeps answering other requests meanwhile (no event-loop stall)."""
    with local_server(TINY_ENGINE) as server:  # default body limit (8 MiB)
        prompt = "lorem ipsum dolor sit amet " * 80_000  # ~2.2 MB, < the body limit
        health_latencies: list[float] = []
        done = threading.Event()

        def poll_health() -> None:
            with httpx.Client(base_url=server.base_url, timeout=30) as http:
                while not done.is_set() and len(health_latencies) < 500:
                    start = time.monotonic()
                    http.get("/health")
                    health_latencies.append(time.monotonic() - start)
                    time.sleep(0.02)

        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        time.sleep(0.2)
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            start = time.monotonic()
            response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            elapsed = time.monotonic() - start
        done.set()
        poller.join(timeout=30)
        assert response.status_code == 400 and is_openai_error(response), response.text[:200]
        worst_health = max(health_latencies)
        assert elapsed < 1.0 and worst_health < 0.5, (
            f"rejecting a {len(prompt)}-char prompt took {elapsed:.1f}s; /health stalled for "
            f"up to {worst_health:.1f}s")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keys_never_in_serve_logs(serve_session: Any) -> None:
    """Run the Serve app with a key (DEBUG logs on), then search every Ray log file."""
    app_args = {"engine_kwargs": dict(TINY_ENGINE), "api_keys": [API_KEY, OTHER_KEY]}
    with serve_session.deploy(app_args) as base_url:
        responses = exercise(base_url)
        wait_replicas_idle(base_url, {"Authorization": f"Bearer {API_KEY}"})
    auth_errors = [r.text for r in responses[3:10]] + [str(dict(r.headers)) for r in responses]
    assert not leaked(auth_errors), leaked(auth_errors)
    time.sleep(2)  # let the workers flush their log files
    logs_dir = serve_session.logs_dir()
    files = [p for p in logs_dir.rglob("*") if p.is_file()]
    assert files, f"no log files under {logs_dir}"
    hits = []
    for path in files:
        data = path.read_bytes()
        hits += [f"{path.name}: {s}" for s in (API_KEY, OTHER_KEY, WRONG_KEY) if s.encode() in data]
    assert not hits, hits
