"""loadtests/gpu_first_light.py --dry-run on CPU: the prepared GPU script's code runs here.

The dry run is the real script with a CPU plan: engine-vs-HF greedy parity on the built-in
model (fp32 and bf16), the step probe on a small dummy Llama and its CostModel fit; the
Serve and kernel-bench stages need a GPU and report themselves skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.loadtests import gpu_first_light as fl
from iterserve.replica.sim_runner import CostModel

pytest.importorskip("transformers")


@pytest.mark.slow
def test_dry_run_writes_a_report_and_a_fitted_cost_model(tmp_path: Path) -> None:
    assert fl.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert report.count("| parity |") == 2 and "3/3 prompts identical" in report
    assert "| serve | Ray Serve replica on the GPU | skipped in --dry-run |" in report
    assert "| step probe |" in report and "FAILED" not in report
    cost = CostModel.from_json(tmp_path / "cost_model.json")  # what the simulator reads
    assert cost.a_s > 0


def test_gpu_plan_is_the_issue_plan() -> None:
    plan = fl.Plan.for_gpu()
    assert plan.device == "cuda" and plan.run_gpu_stages
    assert plan.probe_model["hidden_size"] == 4096 and plan.probe_model["num_hidden_layers"] == 32
    assert len(plan.probe_batches) * len(plan.probe_prompt_lens) >= 4  # enough steps to fit 4


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
