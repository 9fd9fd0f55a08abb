"""Seeded workloads: same seed, same requests; lengths follow the buckets and are exact."""

from __future__ import annotations

import random
import statistics

import pytest

from iterserve.autoscale.sim import workload as w
from iterserve.loadtests import workload as workload_cli
from iterserve.loadtests.streaming import completion_body


def test_the_same_seed_gives_the_same_requests() -> None:
    first, again = w.make_workload(50, seed=7), w.make_workload(50, seed=7)
    assert [(r.prompt_token_ids, r.max_tokens) for r in first] == [
        (r.prompt_token_ids, r.max_tokens) for r in again]
    other = w.make_workload(50, seed=8)
    assert [r.prompt_token_ids for r in first] != [r.prompt_token_ids for r in other]


def test_prefixes_are_stable_when_more_requests_are_asked_for() -> None:
    assert w.make_workload(5, seed=1) == w.make_workload(20, seed=1)[:5]


def test_default_lengths_follow_buckets_weights_and_caps() -> None:
    requests = w.make_workload(600, seed=0, vocab_size=4096)
    spans = {b.name: (b.low, b.high) for b in w.DEFAULT_PROMPT_BUCKETS}
    for request in requests:
        low, high = spans[request.kind]
        assert low <= len(request.prompt_token_ids) <= high
        assert 8 <= request.max_tokens <= 512
        assert all(16 <= t < 4096 for t in request.prompt_token_ids[:8])
    share = {name: sum(r.kind == name for r in requests) / len(requests) for name in spans}
    assert share["short"] == pytest.approx(0.5, abs=0.06)
    assert share["long"] == pytest.approx(0.2, abs=0.05)  # 3 sigma at n=600
    assert statistics.mean(r.max_tokens for r in requests) == pytest.approx(128, rel=0.15)


def test_output_length_kinds() -> None:
    rng = random.Random(0)
    assert {w.OutputLengths.fixed(64).sample(rng) for _ in range(20)} == {64}
    uniform = [w.OutputLengths.uniform(10, 12).sample(rng) for _ in range(200)]
    assert set(uniform) == {10, 11, 12}
    assert w.parse_output_lengths("exponential:32:4-64") == w.OutputLengths.exponential(32, 4, 64)
    assert w.parse_output_lengths("uniform:1-9") == w.OutputLengths.uniform(1, 9)
    with pytest.raises(ValueError):
        w.parse_output_lengths("gaussian:3")


def test_buckets_parse_and_validate() -> None:
    buckets = w.parse_buckets("a:1-4:1,b:8-8:3")
    assert buckets == (w.LengthBucket("a", 1, 4, 1.0), w.LengthBucket("b", 8, 8, 3.0))
    with pytest.raises(ValueError, match="bad bucket"):
        w.parse_buckets("a:4-1:1")


def test_requests_that_cannot_fit_the_model_are_refused() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        w.make_workload(50, seed=0, max_model_len=256)


def test_completion_body_asks_for_exact_lengths() -> None:
    request = w.make_workload(1, seed=0)[0]
    body = completion_body(request, "tiny")
    assert body["prompt"] == request.prompt_token_ids and body["ignore_eos"] is True
    assert body["max_tokens"] == body["min_tokens"] == request.max_tokens
    assert body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in completion_body(request, "tiny", stream=False)


def test_the_cli_prints_the_same_requests_as_the_library(capsys) -> None:
    import json

    assert workload_cli.main(["--num-requests", "3", "--seed", "5"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = w.make_workload(3, seed=5)
    assert [row["prompt_token_ids"] for row in printed] == [r.prompt_token_ids for r in expected]
    assert [row["max_tokens"] for row in printed] == [r.max_tokens for r in expected]
