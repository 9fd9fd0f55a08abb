"""The HTTP KV-tier study's workloads: what is timed, and which prefixes a request can reuse."""

from __future__ import annotations

from iterserve.loadtests.studies.kv_tiers.kv_tiers_bench import ChatWorkload
from iterserve.loadtests.studies.kv_tiers.kv_tiers_http import (
    RagWorkload,
    chat_requests,
    percentile,
    rag_requests,
)


def test_chat_times_returning_turns_that_extend_their_history() -> None:
    workload = ChatWorkload(conversations=3, first_tokens=64, new_tokens=8, answer_tokens=4,
                            turns=2)
    requests = chat_requests(workload, seed=1)
    assert len(requests) == 9 and [r.timed for r in requests] == [False] * 3 + [True] * 6
    for earlier, later in zip(requests, requests[3:], strict=False):
        # The same conversation a turn later: its whole history, then answer and new tokens.
        assert later.prompt[:len(earlier.prompt)] == earlier.prompt
        assert len(later.prompt) == len(earlier.prompt) + 12
    assert chat_requests(workload, seed=1) == requests != chat_requests(workload, seed=2)


def test_rag_times_later_visits_of_a_document_only() -> None:
    workload = RagWorkload(documents=4, doc_tokens=32, system_tokens=8, question_tokens=4,
                           answer_tokens=2, requests=40, zipf=0.6)
    requests = rag_requests(workload, seed=3)
    system = requests[0].prompt[:8]
    seen: set[tuple[int, ...]] = set()
    for request in requests:
        assert request.prompt[:8] == system and len(request.prompt) == 44
        document = tuple(request.prompt[8:40])
        assert request.timed == (document in seen)
        seen.add(document)
    assert 1 < len(seen) <= 4 and sum(r.timed for r in requests) == 40 - len(seen)


def test_percentile_is_nearest_rank_from_below() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 0.99) == 2.0
