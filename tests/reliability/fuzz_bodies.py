"""Hypothesis strategies for hostile request bodies of /v1/completions and /v1/chat/completions.

A body starts from a small valid request and has a few fields set to hostile values (wrong
types, negative and huge numbers, control characters, lone surrogates, mixed lists, values
past the bounds of n / logprobs / max_tokens), deleted, or joined by unknown fields. Raw byte
bodies (malformed or truncated JSON, invalid UTF-8, NaN literals, deep nesting, UTF-16, BOM)
and wrong content types cover what a JSON encoder would never produce.

`check_response` is the oracle: every answer is a 2xx with a well-formed body, or a 4xx in
OpenAI's error shape; never a 5xx, never a non-JSON error.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st
from reliability_support import is_openai_error, sse_events

COMMON_FIELDS = [
    "model", "n", "temperature", "top_p", "stop", "seed", "presence_penalty",
    "frequency_penalty", "stream", "stream_options", "user", "logit_bias", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "priority", "max_tokens",
]
COMPLETION_FIELDS = COMMON_FIELDS + ["prompt", "logprobs", "echo", "best_of", "suffix",
                                     "add_special_tokens"]
CHAT_FIELDS = COMMON_FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                               "tools", "tool_choice", "response_format", "add_generation_prompt"]
UNKNOWN_FIELDS = ["unknown", "__proto__", "", "constructor", "\x00", "prompt ", "N", "Stream"]
CONTENT_TYPES = [
    "application/json", "application/json", "application/json", "application/json; charset=utf-8",
    None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1", "application/xml", "*/*",
]
NASTY_STRINGS = ["", " ", "\x00", "\ud800", "\udfff", "\ud83d", "\x1b[31mred", "\u202e\u2066",
                 "\r\n\r\ndata: [DONE]\n\n", "<|begin_of_text|>", "<|eot_id|>", "\ufeff",
                 "%s%n%x", "{{ raise }}", "{% for x in y %}", "\\u0000", "a" * 5000,
                 "\U0010ffff", "🙂" * 100]
BIG_INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63),
            -(2**63) - 1, 10**30, -(10**30)]
# json.dumps writes NaN / Infinity literals, which the JSON parser of the server accepts.
EXTREME_FLOATS = [float("inf"), float("-inf"), float("nan"), 1e308, -1e308, -0.0, 5e-324]
TOKENIZE_FIELDS = ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"]
DETOKENIZE_FIELDS = ["model", "tokens"]


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(BIG_INTS),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from(EXTREME_FLOATS),
        st.floats(min_value=-3, max_value=3),
        st.text(max_size=40),
        st.text(alphabet=st.characters(codec="utf-8", categories=["Cc", "Cf", "Co", "Zl", "Zp"]),
                max_size=20),
        st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3),  # surrogates
        st.sampled_from(NASTY_STRINGS),
    )


def values() -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars(),
        lambda inner: st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )


def near_bounds() -> st.SearchStrategy[Any]:
    """Numbers around every bound the schemas and the engine enforce."""
    return st.one_of(st.integers(min_value=-3, max_value=40), st.sampled_from(BIG_INTS),
                     st.floats(min_value=-5, max_value=15), st.sampled_from([0.0, -0.0, 1e-320]),
                     st.sampled_from(EXTREME_FLOATS))


def token_ids() -> st.SearchStrategy[Any]:
    token = st.one_of(st.integers(min_value=0, max_value=4200), st.sampled_from(BIG_INTS))
    return st.one_of(st.lists(token, max_size=8), values())


def prompts() -> st.SearchStrategy[Any]:
    token = st.one_of(st.integers(min_value=0, max_value=4200), st.sampled_from(BIG_INTS))
    return st.one_of(
        st.text(max_size=60),
        st.sampled_from(NASTY_STRINGS),
        st.lists(token, max_size=8),
        st.lists(token, min_size=120, max_size=300),  # past the context
        st.lists(st.lists(token, max_size=5), max_size=4),
        st.lists(st.text(max_size=20), max_size=4),
        st.lists(st.one_of(token, st.text(max_size=5), st.none(), st.lists(token, max_size=2)),
                 min_size=1, max_size=5),  # mixed types
        st.just("x" * 20000),  # long text: tokenised, then rejected for the context
        values(),
    )


def messages() -> st.SearchStrategy[Any]:
    role = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer",
                                      "bogus", "", "USER"]), scalars())
    part = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "audio", ""]),
                               "text": st.one_of(st.text(max_size=20), scalars())}),
        values(),
    )
    content = st.one_of(st.text(max_size=60), st.sampled_from(NASTY_STRINGS), st.none(),
                        st.lists(part, max_size=3), scalars())
    message = st.one_of(
        st.fixed_dictionaries({"role": role, "content": content},
                              optional={"name": scalars(), "extra": values()}),
        values(),
    )
    return st.one_of(st.lists(message, max_size=4), values())


FIELD_VALUES: dict[str, Any] = {
    "prompt": prompts,
    "messages": messages,
    "n": near_bounds,
    "logprobs": lambda: st.one_of(near_bounds(), st.booleans()),
    "top_logprobs": near_bounds,
    "max_tokens": lambda: st.one_of(near_bounds(), st.integers(min_value=1, max_value=200)),
    "max_completion_tokens": near_bounds,
    "best_of": near_bounds,
    "stop": lambda: st.one_of(st.lists(st.text(max_size=4), max_size=10), scalars()),
    "stop_token_ids": lambda: st.lists(st.sampled_from(BIG_INTS), max_size=4),
    "seed": lambda: st.one_of(st.sampled_from(BIG_INTS), st.integers()),
    "priority": lambda: st.sampled_from(BIG_INTS),
    "top_k": lambda: st.sampled_from(BIG_INTS),
    "logit_bias": lambda: st.dictionaries(
        st.one_of(st.sampled_from([str(i) for i in BIG_INTS]), st.text(max_size=4)),
        st.one_of(st.sampled_from(EXTREME_FLOATS + [100.0, -100.0, 100.5]), scalars()),
        max_size=3),
    "tokens": token_ids,
    "stream_options": lambda: st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": scalars(),
                                            "continuous_usage_stats": scalars()}), values()),
    "response_format": lambda: st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", ""])}), values()),
}


def field_value(name: str) -> st.SearchStrategy[Any]:
    specific = FIELD_VALUES.get(name)
    generic = st.one_of(near_bounds(), values())
    return st.one_of(specific(), generic) if specific is not None else generic


@st.composite
def json_bodies(draw: st.DrawFn, endpoint: str) -> Any:
    """A valid small body with a few fields set hostile, deleted or unknown."""
    if draw(st.integers(min_value=0, max_value=19)) == 19:
        return draw(values())  # not an object at all, sometimes
    body, names = VALID_BODIES[endpoint]
    body = json.loads(json.dumps(body))
    chosen = draw(st.lists(st.sampled_from(names + UNKNOWN_FIELDS), min_size=1, max_size=4,
                           unique=True))
    for name in chosen:
        if draw(st.integers(min_value=0, max_value=5)) == 5:
            body.pop(name, None)
        else:
            body[name] = draw(field_value(name))
    if endpoint in ("completions", "chat") and draw(st.booleans()) and "stream" not in chosen:
        body["stream"] = True
    return body


VALID_BODIES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "chat": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
              "temperature": 0}, CHAT_FIELDS),
    "completions": ({"prompt": "Hello", "max_tokens": 4, "temperature": 0}, COMPLETION_FIELDS),
    "tokenize": ({"prompt": "Hello"}, TOKENIZE_FIELDS),
    "detokenize": ({"tokens": [11, 12, 13]}, DETOKENIZE_FIELDS),
}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
         "tokenize": "/tokenize", "detokenize": "/detokenize"}


def encode_json(body: Any, mode: int) -> bytes:
    """JSON text as bytes in several legal-looking and illegal encodings."""
    if mode == 0:
        return json.dumps(body).encode()  # ASCII with \\uXXXX escapes (lone surrogates too)
    if mode == 1:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")  # CESU-8
    if mode == 2:
        return json.dumps(body, ensure_ascii=False).encode("utf-16", "surrogatepass")
    return b"\xef\xbb\xbf" + json.dumps(body).encode()  # UTF-8 BOM


RAW_BODIES = [
    b"", b" ", b"null", b"[]", b'"prompt"', b"0", b"{", b"}", b"{}", b"{{}}", b"\x00",
    b'{"prompt": NaN, "max_tokens": 2}', b'{"prompt": "a", "max_tokens": Infinity}',
    b'{"prompt": "a", "temperature": -Infinity}', b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}',
    b'{"prompt": "a\xc0\x80b", "max_tokens": 2}', b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}',
    b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 2}', b'{"prompt": "a",}',
    b"{'prompt': 'a'}", b'{"prompt": "a" "max_tokens": 2}', b'{"prompt": "\\ud800"}',
    b'{"prompt": "\\u0000", "max_tokens": 1}', b'{"prompt": "a", "max_tokens": 1e400}',
    b'{"prompt": "a", "max_tokens": 1.0}', b'{"prompt": "a", "max_tokens": "3"}',
    b'{"prompt": "a", "n": 1e2}', b'{"prompt": [1, 2, 3], "max_tokens": 2, "stream": "yes"}',
    b'{"messages": [{"role": "user", "content": "a"}], "logprobs": 1, "top_logprobs": 99}',
    b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"prompt": [' + b"1," * 5000 + b"1]}",
    b'prompt=hello&max_tokens=2', b"--x\r\nContent-Disposition: form-data; name=prompt\r\n\r\na\r\n--x--",
]


@st.composite
def raw_bodies(draw: st.DrawFn, endpoint: str) -> bytes:
    kind = draw(st.integers(min_value=0, max_value=3))
    if kind == 0:
        return draw(st.sampled_from(RAW_BODIES))
    if kind == 1:
        return draw(st.binary(max_size=300))
    valid = encode_json(draw(json_bodies(endpoint)), 0)
    if kind == 2:  # truncated JSON
        return valid[: draw(st.integers(min_value=0, max_value=max(0, len(valid) - 1)))]
    position = draw(st.integers(min_value=0, max_value=len(valid)))  # a stray byte
    return valid[:position] + draw(st.binary(min_size=1, max_size=3)) + valid[position:]


@dataclass
class FuzzCase:
    path: str
    body: bytes
    content_type: str | None
    authorized: bool

    def headers(self, api_key: str | None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.content_type is not None:
            headers["Content-Type"] = self.content_type
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key if self.authorized else 'sk-wrong'}"
        return headers


@st.composite
def fuzz_cases(draw: st.DrawFn) -> FuzzCase:
    endpoint = draw(st.sampled_from(["completions", "chat", "completions", "chat", "tokenize",
                                     "detokenize"]))
    path = PATHS[endpoint]
    if draw(st.integers(min_value=0, max_value=3)) == 3:
        body = draw(raw_bodies(endpoint))
    else:
        mode = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))
        body = encode_json(draw(json_bodies(endpoint)), mode)
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    authorized = draw(st.integers(min_value=0, max_value=15)) != 15  # hypothesis favours 0
    return FuzzCase(path, body, content_type, authorized)


@dataclass
class FuzzTally:
    """What the fuzzer sent and got back (recorded in RELIABILITY.md)."""

    num_inputs: int = 0
    statuses: Counter = field(default_factory=Counter)
    stream_errors: int = 0

    def summary(self) -> dict[str, Any]:
        return {"num_inputs": self.num_inputs,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "stream_error_events": self.stream_errors}


def check_response(case: FuzzCase, response: httpx.Response, tally: FuzzTally) -> None:
    """The oracle: 2xx well formed, or 4xx in OpenAI's error shape; never 5xx."""
    tally.num_inputs += 1
    tally.statuses[response.status_code] += 1
    status = response.status_code
    assert status < 500, f"{status} for {case!r}: {response.text[:500]}"
    if status >= 400:
        assert is_openai_error(response), f"{status} not OpenAI-shaped for {case!r}: {response.text[:300]}"
        if status == 401:
            assert not case.authorized
        return
    assert status == 200, f"unexpected {status} for {case!r}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(response.text)
        assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        tally.stream_errors += len(errors)
        assert not errors, f"error event in stream for {case!r}: {errors}"
    elif case.path == "/tokenize":
        body = response.json()
        assert body["count"] == len(body["tokens"]), body
    elif case.path == "/detokenize":
        assert isinstance(response.json()["prompt"], str)
    else:
        body = response.json()
        assert isinstance(body.get("choices"), list) and body["choices"], body
        assert body["usage"]["completion_tokens"] >= 1, body
