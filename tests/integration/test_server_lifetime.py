"""The servers a command starts end with it, however it ends (loadtests/servers.py).

* `iterserve bench` stopped by SIGTERM mid-run (what `timeout` sends) stops both of its
  `iterserve serve` servers: no process of theirs (Ray's included) is left, their ports are
  closed, and the bench exits 143 saying so;
* a program holding a server from `serve_mode` that is killed outright (SIGKILL: no handler
  runs) still takes its server with it: the kernel sends the server SIGTERM
  (PR_SET_PDEATHSIG), and the server stops cleanly;
* an experiment that embeds Ray (`sim_harness.start_ray`) and gets SIGTERM shuts its
  cluster down: no process of it is left (ray.init's own handler aborted and left Ray's
  agents running).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proctools import children, port_open, session_processes, wait_until_gone

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TINY = ("--model iterserve-tiny --device cpu --max-model-len 512 "
        "--num-gpu-blocks-override 256 --ray-num-cpus 2")
READY = re.compile(r"ready at http://127\.0\.0\.1:(\d+)/v1")


def _ports_when_ready(logs: list[Path], proc: subprocess.Popen[bytes], timeout_s: float = 400
                      ) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [READY.search(log.read_text()) if log.is_file() else None for log in logs]
        if all(found):
            return [int(m.group(1)) for m in found if m]
        assert proc.poll() is None, "the starter ended before its servers were up"
        assert time.monotonic() < deadline, "the servers did not come up"
        time.sleep(0.5)


def _assert_gone(servers: list[int], ports: list[int]) -> None:
    for pid in servers:
        assert wait_until_gone(pid, timeout_s=90) == [], f"server {pid} left processes"
    assert not [port for port in ports if port_open(port)]


def test_bench_stopped_by_sigterm_stops_its_servers(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "iterserve.loadtests.bench", "--quick", "--no-progress",
            f"--serve-args={TINY}", "--log-dir", str(logs), "--out", str(tmp_path / "out"),
            "--report", str(tmp_path / "report.md"), "--min-requests", "64",
            "--max-requests", "64"]
    bench = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                             start_new_session=True)
    servers: list[int] = []
    try:
        ports = _ports_when_ready([logs / "serve-static.log", logs / "serve-continuous.log"],
                                  bench)
        servers = children(bench.pid)
        assert len(servers) == 2
        bench.send_signal(signal.SIGTERM)  # the bench alone, as `timeout` does
        signalled = time.monotonic()
        output = bench.communicate(timeout=300)[0].decode()
        print(f"bench SIGTERM to exit: {time.monotonic() - signalled:.1f} s")
        assert bench.returncode == 128 + signal.SIGTERM, output
        assert "iterserve bench: SIGTERM: stopped, and the servers it started" in output
        assert "Traceback" not in output, output
        _assert_gone(servers, ports)
        for log in logs.glob("serve-*.log"):  # each drained (nothing left in flight) and ended
            assert "stopped" in log.read_text() and "*** " not in log.read_text()
    finally:
        for pid in [bench.pid, *servers]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue


STARTER = """
import sys, time
from pathlib import Path
from iterserve.loadtests.servers import serve_mode
with serve_mode("continuous", sys.argv[2].split(), Path(sys.argv[1]), None) as (url, _):
    print(url, flush=True)
    time.sleep(600)
"""


def test_a_killed_starter_takes_its_server_with_it(tmp_path: Path) -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path), TINY], cwd=REPO,
                               stdout=subprocess.PIPE, start_new_session=True,
                               env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    servers: list[int] = []
    try:
        (port,) = _ports_when_ready([tmp_path / "serve-continuous.log"], starter)
        servers = children(starter.pid)
        assert len(servers) == 1
        starter.kill()  # SIGKILL: no handler of the starter runs
        starter.wait(timeout=30)
        killed = time.monotonic()
        _assert_gone(servers, [port])
        print(f"starter SIGKILL to its server gone: {time.monotonic() - killed:.1f} s")
        log = (tmp_path / "serve-continuous.log").read_text()
        assert "SIGTERM: no request in flight; stopped" in log, log
    finally:
        for pid in [starter.pid, *servers]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue


EMBEDDED = """
import time
from iterserve.loadtests.studies.ray_harness import start_ray
start_ray(num_cpus=2)
print("up", flush=True)
time.sleep(600)
"""


def test_an_experiment_embedding_ray_shuts_it_down_on_sigterm() -> None:
    driver = subprocess.Popen([sys.executable, "-c", EMBEDDED], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True,
                              env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        assert driver.stdout is not None
        while (line := driver.stdout.readline().decode()).strip() != "up":
            assert line, "the driver ended before Ray was up"
        assert len(session_processes(driver.pid)) > 1  # Ray's processes, in its session
        driver.send_signal(signal.SIGTERM)
        output = driver.communicate(timeout=120)[0].decode()
        assert "SIGTERM received at time" not in output, output
        assert wait_until_gone(driver.pid, timeout_s=60) == []
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing of it was left
