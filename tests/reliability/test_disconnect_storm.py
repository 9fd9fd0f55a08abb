"""Disconnect storm: 200 streaming requests dropped at random points during normal traffic.

Afterwards no request and no KV block is left behind, and the normal requests (greedy) gave
exactly the outputs of a reference run without the storm. The KV cache is small enough that
the storm also forces preemptions, so aborts race with preemption and recompute.

In process (uvicorn + create_app + the real engine), every engine table is checked to be
empty; on Ray Serve, the replicas' stats and their count of cancelled streams are checked.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from reliability_support import local_server, run_async, wait_replicas_idle

from iterserve.loadtests.studies.reliability.chaos import disconnect_storm

STORM_ENGINE: dict[str, Any] = {
    "model": "iterserve-tiny",
    "device": "cpu",
    "max_model_len": 128,
    "num_gpu_blocks_override": 40,  # 640 tokens for 16 sequences: preemption happens
    "max_num_batched_tokens": 256,
    "max_num_seqs": 16,
}
NUM_CANCELLED = 200
NUM_NORMAL = 24


def test_disconnect_storm_in_process() -> None:
    with local_server(STORM_ENGINE) as server:
        aborts: list[str] = []
        engine = server.engine.engine
        original_abort = engine.abort_request

        def counting_abort(request_id: str) -> Any:  # runs on the engine thread
            outputs = original_abort(request_id)
            if outputs:
                aborts.append(request_id)
            return outputs

        engine.abort_request = counting_abort
        result = run_async(disconnect_storm(server.base_url, None, NUM_CANCELLED, NUM_NORMAL,
                                            seed=1), timeout_s=400)
        state = server.wait_idle(timeout_s=60)
        preemptions = server.engine.stats().num_preemptions
    print("disconnect storm (in process):", json.dumps(result.to_dict()),
          f"aborted_in_engine={len(aborts)} preemptions={preemptions}")
    assert result.ok, result.to_dict()
    assert len(aborts) >= NUM_CANCELLED // 2, f"only {len(aborts)} requests were aborted"
    assert state["num_free_blocks"] == state["num_total_blocks"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_disconnect_storm_serve(serve_session: Any) -> None:
    app_args = {"engine_kwargs": dict(STORM_ENGINE)}
    with serve_session.deploy(app_args) as base_url:
        result = run_async(disconnect_storm(base_url, None, NUM_CANCELLED, NUM_NORMAL, seed=2),
                           timeout_s=500)
        stats = wait_replicas_idle(base_url, timeout_s=30)  # < 1 s when nothing leaked
    print("disconnect storm (Serve):", json.dumps(result.to_dict()), json.dumps(stats))
    assert result.ok, result.to_dict()
    cancelled = sum(s["num_cancelled"] or 0 for s in stats)
    assert cancelled >= NUM_CANCELLED // 2, f"replicas saw only {cancelled} cancelled streams"
