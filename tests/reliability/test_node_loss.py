"""A node lost under streaming load (issue 14 part 3): `loadtests/studies/reliability/node_loss.py` on a
two-node Ray cluster on this machine (head + worker, one LLMReplica each), the worker's
raylet killed mid-load, the node then added back. Run in a subprocess so that its Ray cluster
is its own. Floors asserted:

* the lost replica carried traffic: it had served requests before the kill, ran at least two
  at the kill (the script waits for that: a CI run on a loaded box once killed it idle), and
  some streams were under way on it (without this every floor below would hold vacuously, as
  it did while the ingress's tokenizer load held the first requests past the kill);
* requests that start after the fault all complete (0 lost), and streams in flight at the
  fault either complete or end as below;
* streams under way on the lost replica end with an SSE error event and then [DONE] (none
  hangs, none is cut without an error), within a bound set by Ray's death detection;
* the router sends the dead replica nothing once its worker has exited (within one routing
  stats period), and nothing after it learnt of the death;
* Serve runs two replicas again once the node is back;
* Serve never holds more than one replica beyond the count before the fault.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

STREAM_ERROR_BOUND_S = 30.0  # Ray marks a node dead after 5 missed 3 s health checks: 15 s


def test_node_loss_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "node_loss.json"
    # Ray's socket paths must stay under 107 bytes: a short folder, not pytest's tmp_path.
    ray_dir = tempfile.mkdtemp(prefix="iterserve-nl-", dir="/tmp")
    # 8 long-stream clients (150 tokens, ~3 s) and 8 short probe clients: streams under way
    # on the lost node, and frequent routing decisions around the kill.
    command = [sys.executable, "-m", "iterserve.loadtests.studies.reliability.node_loss", "--clients", "8",
               "--max-tokens", "150", "--probe-clients", "8", "--probe-tokens", "16",
               "--down-s", "8", "--temp-dir", ray_dir, "--json", str(out)]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=540)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    print("node loss:", json.dumps({k: v for k, v in result.items()
                                    if k not in ("router_decisions_around_kill",
                                                 "ingress_log")}))
    dead = result["dead_replica"]
    # not vacuous: the replica on the lost node served requests and had streams under way
    assert result["generate_calls_before_kill"].get(dead, 0) > 0, result["timeline"]
    assert result["routed_to_dead_replica_before_kill"] > 0
    assert result["running_before_kill"][dead] >= 2
    assert result["in_flight_failed"] > 0, "no stream was under way on the lost replica"
    assert result["started_after_kill"] > 0 and result["started_after_kill_failed"] == 0
    assert result["in_flight_failed"] == result["in_flight_failed_with_sse_error"], \
        result["failures"]
    assert result["in_flight_failed_with_done"] == result["in_flight_failed"]
    assert max(result["in_flight_error_after_kill_s"]) < STREAM_ERROR_BOUND_S
    period = result["routing_stats_period_s"]
    stopped = result["router_stopped_after_worker_exit_s"]
    assert stopped is not None and stopped <= period + result["sample_period_s"]
    learnt = result["router_learnt_of_death_after_kill_s"]
    assert learnt is not None and result["last_sent_to_dead_replica_after_kill_s"] <= learnt
    assert result["max_replicas_after_fault"] <= result["replicas_before_fault"] + 1
    assert any("two replicas answer again" in event for _, event in result["timeline"])
