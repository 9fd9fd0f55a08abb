"""gpu_first_light.py --dry-run on CPU: the prepared GPU script's code runs here.

The dry run is the real script with a CPU plan: engine-vs-HF greedy parity on the built-in
model (fp32 and bf16), the structured-output stage on a small batch (the ratio reported, the
GPU floor not judged), the step probe on a small dummy Llama and its CostModel fit; the
Serve and kernel-bench stages need a GPU and report themselves skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.loadtests.studies.gpu_first_light import gpu_first_light as fl
from iterserve.replica.sim_runner import CostModel

pytest.importorskip("transformers")


@pytest.mark.slow
def test_dry_run_writes_a_report_and_a_fitted_cost_model(tmp_path: Path) -> None:
    assert fl.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert report.count("| parity |") == 2 and "3/3 prompts identical" in report
    assert "| serve | Ray Serve replica on the GPU | skipped in --dry-run |" in report
    assert "| step probe |" in report and "FAILED" not in report
    overhead = next(line for line in report.splitlines() if line.startswith("| structured overhead |"))
    assert "batch 8 x 6 tokens" in overhead and "x**" in overhead and "a GPU floor" in overhead
    assert "| structured validity |" in report and "3/3 valid" in report
    cost = CostModel(**json.loads((tmp_path / "cost_model.json").read_text()))
    assert cost.a_s > 0


def test_gpu_plan_is_the_issue_plan() -> None:
    plan = fl.Plan.for_gpu()
    assert plan.device == "cuda" and plan.run_gpu_stages
    assert plan.probe_model["hidden_size"] == 4096 and plan.probe_model["num_hidden_layers"] == 32
    assert len(plan.probe_batches) * len(plan.probe_prompt_lens) >= 4  # enough steps to fit 4
    assert plan.structured.batch == 64 and fl.STRUCTURED_FLOOR == 0.8  # the issue's overhead check


def test_builtin_model_is_the_engines_default() -> None:
    try:
        from iterserve.replica.model_source import resolve_model_path
    except ImportError:
        from iterserve.replica.make_model import default_model_path as resolve_default

        assert fl.builtin_model() == resolve_default()
    else:
        assert fl.builtin_model() == resolve_model_path(None)


def test_needs_a_gpu_without_dry_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fl.main([]) == 2


@pytest.mark.parametrize(("ratio", "verdict"), [(0.85, "ok"), (0.79, "FAILED")])
def test_structured_stage_judges_the_gpu_floor(monkeypatch: pytest.MonkeyPatch, ratio: float,
                                               verdict: str) -> None:
    """The GPU plan's verdicts, from the figures the benchmark functions return (no GPU here:
    the model and the measurements are stand-ins; the dry run above runs the real ones)."""
    from types import SimpleNamespace

    from iterserve.loadtests.studies.structured_outputs import structured_bench
    from iterserve.replica import structured_output

    stats = structured_output.CompileStats(num_requests=4, num_cache_hits=3, compile_times_s=())
    pool = SimpleNamespace(stats=lambda: stats)
    engine = SimpleNamespace(constrained=SimpleNamespace(pool=pool, shutdown=lambda: None))
    monkeypatch.setattr("iterserve.replica.LLM", lambda *a, **k: SimpleNamespace(engine=engine))
    monkeypatch.setattr(structured_bench, "overhead", lambda *a: {
        "free_tok_s": [1000.0], "constrained_tok_s": [1000.0 * ratio],
        "ratio_constrained_over_free": ratio})
    monkeypatch.setattr(structured_bench, "validity", lambda *a, **k: {
        "requests": 16, "valid": 16, "finish_reasons": {"stop": 16}, "seconds": 1.0})
    monkeypatch.setattr(structured_bench, "compile_times", lambda *a: {
        "schemas": 101, "p50_ms": 1.0, "p99_ms": 5.0})
    overhead_row, validity_row = fl.stage_structured(fl.Plan.for_gpu())
    assert overhead_row[-1] == verdict and f"**{ratio}x**" in overhead_row[2]
    assert validity_row[-1] == "ok" and "16/16 valid" in validity_row[2]
