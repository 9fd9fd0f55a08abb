"""A short soak (the CI version of loadtests/studies/reliability/soak.py's 10-minute run):
headless Locust against the Serve app for SOAK_SECONDS (default 40), sampling replica RSS.

Zero failures, RSS growth of the LLMReplica process under 5 % after a short warm-up, and
exact block accounting at the end. The 10-minute figure is in RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
from reliability_support import TINY_ENGINE

from iterserve.loadtests.studies.reliability.soak import replica_infos, run_soak, session_pids

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "40"))


def test_soak_short(serve_session: Any, tmp_path: Path) -> None:
    engine = {**TINY_ENGINE, "max_model_len": 256, "num_gpu_blocks_override": 128}
    with serve_session.deploy({"engine_kwargs": engine}) as base_url:
        pids = session_pids()
        assert len(pids["LLMReplica"]) == 1, pids
        vocab = int(replica_infos(base_url)[0]["vocab_size"])
        args = argparse.Namespace(duration=SOAK_SECONDS, users=4, warmup=min(10.0, SOAK_SECONDS / 4),
                                  sample_interval=1.0, max_rss_growth=5.0, seed=0,
                                  prompt_buckets="short:16-64:0.7,medium:64-160:0.3",
                                  output_lengths="uniform:16-64", out=str(tmp_path))
        summary = run_soak(base_url, pids, args, vocab)
    printable = {k: v for k, v in summary.items() if k != "replica_stats_after"}
    print("soak (short):", json.dumps(printable))
    assert summary["failures"] == 0 and summary["locust_exit_code"] == 0, printable
    assert summary["completed_streams"] > 0, printable
    assert summary["accounting_exact"], summary["replica_stats_after"]
    for pid, growth in summary["rss"]["LLMReplica"].items():
        assert growth["growth_pct"] is not None and growth["growth_pct"] < 5.0, (pid, growth)
