"""Locust headless, a few seconds, against a local stand-in server with known timings.

The stand-in (`tests/fake_openai.py`) sends headers at once, the first token after
TTFT_S and one token every ITL_S, so the test can check that the locustfile reports the
stream's timings, not Locust's time-to-headers. The same file runs against `iterserve serve`
(see BENCHMARKS_SERVING.md); that run is not part of the test suite.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_openai import serve_fake_openai

import iterserve.loadtests

TTFT_S, ITL_S = 0.08, 0.01
# Not imported here: importing locust monkey-patches this process with gevent.
LOCUSTFILE = Path(iterserve.loadtests.__file__).parent / "locustfile.py"
LOCUST = shutil.which("locust") or str(Path(sys.executable).parent / "locust")


def _run_locust(url: str, out: Path, *extra: str) -> dict[str, dict[str, str]]:
    command = [LOCUST, "-f", str(LOCUSTFILE), "--headless", "--host", url, "-t", "4s",
               "--csv", str(out / "run"), "--html", str(out / "run.html"), "--only-summary",
               "--workload-size", "64", "--output-lengths", "uniform:4-12",
               "--prompt-buckets", "short:4-16:1", "--raw-csv", str(out / "requests.csv"),
               "--stop-timeout", "5", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "run_stats.csv") as handle:
        return {row["Name"]: row for row in csv.DictReader(handle)}


@pytest.mark.slow
@pytest.mark.parametrize("shape_args", [
    ("--shape", "constant", "-u", "4", "-r", "4"),
    ("--shape", "poisson", "--poisson-rate", "8", "--poisson-max-users", "8"),
    ("--shape", "spike", "--spike-base-users", "1", "--spike-users", "6", "--spike-at", "1",
     "--spike-duration", "2"),
    ("--shape", "step", "--step-users", "2", "--step-time", "1", "--step-max-users", "6"),
], ids=["constant", "poisson", "spike", "step"])
def test_locust_reports_stream_timings(tmp_path: Path, shape_args: tuple[str, ...]) -> None:
    with serve_fake_openai(ttft_s=TTFT_S, itl_s=ITL_S) as (url, state):
        rows = _run_locust(url, tmp_path, *shape_args)
    assert state.completed > 0
    headers = rows["POST /v1/completions [headers]"]
    assert int(headers["Request Count"]) > 0 and int(headers["Failure Count"]) == 0
    for name in ("ttft", "itl", "tpot", "e2e"):
        assert int(rows[name]["Request Count"]) > 0, name
    # Stream timings, not time-to-headers: TTFT is at least TTFT_S, the headers come well
    # before it, and ITL is the token gap (bounds leave room for a loaded 2-core machine).
    ttft_ms = float(rows["ttft"]["Median Response Time"])
    assert ttft_ms >= TTFT_S * 1000 * 0.9
    assert float(headers["Median Response Time"]) < ttft_ms * 0.75
    assert ITL_S * 1000 * 0.5 <= float(rows["itl"]["Median Response Time"]) <= ITL_S * 1000 * 4
    assert (tmp_path / "run.html").stat().st_size > 0
    with open(tmp_path / "requests.csv") as handle:
        raw = list(csv.DictReader(handle))
    assert raw and all(4 <= int(row["output_tokens"]) <= 12 for row in raw)
