"""gpu_first_light.py --dry-run on CPU: the prepared GPU script's code runs here.

The dry run is the real script with a CPU plan: engine-vs-HF greedy parity on a SmolLM2-shaped
random model (fp32 and bf16), the engine decode benchmark and the step probe on a small Llama,
the structured-output stage on a small batch (ratios reported, GPU floors not judged); the
kernel bench needs a GPU. One run goes through scripts/gpu_first_light.sh, as the GPU machine
runs it, with every package that machine lacks made unimportable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.loadtests.studies.gpu_first_light import gpu_first_light as fl
from iterserve.loadtests.studies.gpu_first_light.gpu_machine import MISSING
from iterserve.replica.sim_runner import CostModel

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
# Installed first on PYTHONPATH: refuses every package the GPU machine lacks.
BLOCKER = """import importlib.abc, sys
MISSING = {missing!r}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
        return None
sys.meta_path.insert(0, Missing())
"""


def _row(report: str, start: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(start))


@pytest.mark.slow
def test_dry_run_writes_every_stage_and_a_fitted_cost_model(tmp_path: Path) -> None:
    stages = "kernel bench,engine decode,step probe,structured,serve"
    assert fl.main(["--dry-run", "--out", str(tmp_path), "--stages", stages]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "FAILED" not in report and report.startswith("cpu; python ")
    assert "| kernel bench | kernel_bench.py | skipped in --dry-run" in report
    decode = [line for line in report.splitlines() if line.startswith("| engine decode |")]
    assert len(decode) == 4 and all("- (a GPU floor) |" in line for line in decode)
    assert "x byte floor" in decode[0] and "x runner step" in decode[1]
    assert (tmp_path / "engine_decode.md").read_text().count("| engine ") == 4
    assert "| step probe |" in report
    overhead = _row(report, "| structured overhead |")
    assert "batch 8 x 6 tokens" in overhead and "x**" in overhead and "a GPU floor" in overhead
    assert "cold compile p50" in overhead and "(11 schemas)" in overhead
    assert "| serve | Ray Serve replica on the GPU | skipped in --dry-run |" in report
    assert "Stage times: kernel bench " in report
    cost = CostModel(**json.loads((tmp_path / "cost_model.json").read_text()))
    assert cost.a_s > 0
    startup = json.loads((tmp_path / "startup.json").read_text())
    assert {"weights_place", "kv_cache", "ready_s"} <= set(
        startup["step probe model, bf16 (dummy weights)"])


@pytest.mark.slow
def test_the_gpu_script_runs_without_what_the_gpu_machine_lacks(tmp_path: Path) -> None:
    """scripts/gpu_first_light.sh as the GPU runs it (its own import path, no carried wheels),
    with ray, pydantic, xgrammar, gguf, ... refused: parity passes, the stages that need a
    missing package say so."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER.format(missing=sorted(
        {name.replace("-", "_") for name in MISSING} | {"pydantic_core", "starlette"})))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, GPU_CARRY=str(tmp_path / "nothing carried"), PYTHONPATH=str(blocker))
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_first_light.sh", str(out), "--dry-run", "--stages",
                           "imports,parity,structured,serve"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iterserve from " in proc.stdout and "/iterserve-site." in proc.stdout  # not the .venv's
    report = (out / "report.md").read_text()
    assert (out / "first_light.log").read_text().count("| parity |") == 2
    assert "| startup | fresh process: import torch, triton, the engine |" in report
    fp32, bf16 = [line for line in report.splitlines() if line.startswith("| parity |")]
    assert "float32, 8 greedy tokens" in fp32 and "3/3 prompts identical | ok |" in fp32
    assert "bfloat16, 4 greedy tokens" in bf16 and bf16.endswith("| ok |")
    assert report.count("| startup | smollm2-shape ") == 2 and "KV blocks" in report
    assert "| structured | constrained vs free | skipped: xgrammar is not installed" in report
    assert "skipped: ray is not installed, and its wheel (79.3 MB) is over the 64 MiB" in report


def test_gpu_plan_is_the_issue_plan() -> None:
    plan = fl.Plan.for_gpu()
    assert plan.device == "cuda" and plan.run_gpu_stages
    shape = plan.parity_model
    assert (shape["num_hidden_layers"], shape["hidden_size"], shape["num_attention_heads"],
            shape["num_key_value_heads"], shape["vocab_size"]) == (30, 576, 9, 3, 49152)  # fmt: skip
    assert plan.probe_model["hidden_size"] == 4096 and plan.probe_model["num_hidden_layers"] == 32
    assert len(plan.probe_batches) * len(plan.probe_prompt_lens) >= 4  # enough steps to fit 4
    assert plan.structured.batch == 64 and fl.STRUCTURED_FLOOR == 0.8  # the issue's overhead check
    assert plan.decode_bench.device == "cuda" and plan.decode_bench.batches == (1, 16, 64, 256)
    # Under six minutes on an H100 with the start and the wheels' install: the budget holds
    # every stage's estimate, and the dry run shares the GPU's parity shape but its depth.
    assert set(plan.estimate_s) == set(fl.STAGES) and sum(plan.estimate_s.values()) <= plan.budget_s <= 300
    assert fl.Plan.dry_run().parity_model == {**shape, "num_hidden_layers": 2}


def test_a_stage_the_budget_cannot_hold_is_skipped_and_reported(tmp_path: Path) -> None:
    plan = dataclasses.replace(fl.Plan.dry_run(), budget_s=60.0, estimate_s={"step probe": 61.0})
    rows = fl.run_stages(fl.Run(plan, tmp_path, tmp_path, None), ("kernel bench", "step probe"))
    assert rows[-1] == ["step probe", "skipped: time budget",
                        rows[-1][2], "-"] and "the stage takes ~61 s" in rows[-1][2]  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert "| step probe | skipped: time budget |" in report and "budget 60 s" in report
    assert not (tmp_path / "cost_model.json").exists()


def test_needs_a_gpu_without_dry_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fl.main([]) == 2


def test_unknown_stage_is_refused() -> None:
    with pytest.raises(SystemExit):
        fl.main(["--dry-run", "--stages", "parity,warp drive"])


@pytest.mark.parametrize(("ratio", "verdict"), [(0.85, "ok"), (0.79, "FAILED")])
def test_structured_stage_judges_the_gpu_floor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               ratio: float, verdict: str) -> None:
    """The GPU plan's verdict, from the figures the benchmark functions return (no GPU here:
    the model and the measurements are stand-ins; the dry run above runs the real ones)."""
    from types import SimpleNamespace

    pytest.importorskip("xgrammar")
    from iterserve.loadtests.studies.structured_outputs import structured_bench
    from iterserve.replica import structured_output

    stats = structured_output.CompileStats(num_requests=4, num_cache_hits=3, compile_times_s=())
    pool = SimpleNamespace(stats=lambda: stats)
    engine = SimpleNamespace(constrained=SimpleNamespace(pool=pool, shutdown=lambda: None),
                             tokenizer=SimpleNamespace(vocab_size=49152))  # fmt: skip
    monkeypatch.setattr("iterserve.replica.LLM", lambda *a, **k: SimpleNamespace(engine=engine))
    monkeypatch.setattr(structured_bench, "overhead", lambda *a: {
        "free_tok_s": [1000.0], "constrained_tok_s": [1000.0 * ratio],
        "ratio_constrained_over_free": ratio})
    monkeypatch.setattr(structured_bench, "compile_times", lambda *a: {
        "schemas": 101, "p50_ms": 1.0, "p99_ms": 5.0})
    run = fl.Run(fl.Plan.for_gpu(), tmp_path, tmp_path, None, _model=tmp_path / "stand-in")
    (row,) = fl.stage_structured(run)
    assert row[-1] == verdict and f"**{ratio}x**" in row[2] and "tokenizer of 49152 tokens" in row[1]
