"""GPU first light: the first run of iterserve on a GPU, one prepared command, under 6 minutes.

    bash scripts/gpu_first_light.sh OUT          (on the GPU machine: see BENCHMARKS.md)
    python -m iterserve.loadtests.studies.gpu_first_light.gpu_first_light --out runs/first_light
    python -m iterserve.loadtests.studies.gpu_first_light.gpu_first_light --dry-run --out /tmp/fl \
        (CPU, in CI; rehearse.py runs it on the GPU machine's software)

Stages, in this order, each writing its rows into OUT/report.md as it ends (so a run cut
short keeps what was done), each skipped when the time budget (--budget-s) cannot hold it:
1. imports: seconds to import torch, triton and the engine (and initialise CUDA) in a fresh
   process, the first part of a replica's start-up delay.
2. parity (parity.py): a SmolLM2-shaped checkpoint with seeded random weights, the engine
   (KV blocks profiled from gpu_memory_utilization, CUDA graphs) against HF transformers'
   greedy generate: all tokens in fp32, the first 4 in bf16; each engine's start-up phases.
3. kernel bench (kernel_bench.py): bf16 correctness, copy bandwidth, decode attention against
   it (floors), prefill; its own table, kernel_bench.md.
4. engine decode (engine_decode_bench.py): the decode step with CUDA graphs against the byte
   floor, and with async scheduling against the runner step; engine_decode.md.
5. step probe (step_probe.py): CostModel.fit on a Llama-3-8B-shaped model -> cost_model.json.
6. structured: constrained vs free tokens/s on the SmolLM2-shaped model (floor 0.8x on the
   GPU) and schema compile times, where xgrammar was brought (its wheels are carried).
7. serve: one Ray Serve replica answering over HTTP, where ray is installed; the GPU machine
   has none and ray's wheel alone is over the 64 MiB that can travel.
Start-up figures of every engine land in OUT/startup.json. --dry-run runs the same code on
CPU with small settings and judges no GPU floor. Exit code 1 if any stage fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from iterserve.loadtests.studies.gpu_first_light import parity, step_probe
from iterserve.loadtests.studies.gpu_first_light.engine_decode_bench import DecodeBench
from iterserve.loadtests.studies.gpu_first_light.gpu_machine import RAY_WHEEL_MB

STRUCTURED_FLOOR = 0.8  # constrained / free tokens/s on the GPU (issue 15)
SMALL_LLAMA = {
    "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
    "max_position_embeddings": 2048,
}  # fmt: skip
STAGES = ("imports", "parity", "kernel bench", "engine decode", "step probe", "structured", "serve")
# Seconds each stage may take on an H100, about 1.5x the estimate in BENCHMARKS.md ("GPU first
# light": JIT compiles counted at this box's triton 3.6 compile times, work at the H100's rates):
# a stage starts only while the budget (300 s) still holds it.
GPU_ESTIMATE_S = {"imports": 8, "parity": 55, "kernel bench": 90, "engine decode": 70,
                  "step probe": 40, "structured": 30, "serve": 0}  # fmt: skip


@dataclass(frozen=True)
class StructuredPlan:
    """Sizes of the structured-output stage; every run is bounded by its token counts."""

    batch: int  # requests per run, all constrained or all free
    max_tokens: int  # per request and run: both sides generate batch x max_tokens tokens
    rounds: int  # A B pairs
    num_compiles: int  # distinct schemas compiled cold for p50/p99


@dataclass(frozen=True)
class Plan:
    device: str
    parity_model: dict[str, Any]
    num_tokens: int  # greedy tokens compared in fp32
    probe_model: dict[str, Any]
    probe_batches: tuple[int, ...]
    probe_prompt_lens: tuple[int, ...]
    probe_decode_steps: int
    run_gpu_stages: bool
    structured: StructuredPlan
    decode_bench: DecodeBench
    budget_s: float
    estimate_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def for_gpu(cls) -> Plan:
        return cls("cuda", parity.SMOLLM2_135M, 24, step_probe.LLAMA_3_8B, (1, 8, 32, 96),
                   (128, 1024), 8, True, StructuredPlan(batch=64, max_tokens=48, rounds=2,
                                                        num_compiles=100),
                   DecodeBench(), budget_s=300, estimate_s=GPU_ESTIMATE_S)  # fmt: skip

    @classmethod
    def dry_run(cls) -> Plan:
        # SmolLM2's widths, heads and vocab in 2 layers: the same code, a CPU's time.
        smollm2_2_layers = {**parity.SMOLLM2_135M, "num_hidden_layers": 2}
        return cls("cpu", smollm2_2_layers, 8, SMALL_LLAMA, (1, 4), (16, 48), 3, False,
                   StructuredPlan(batch=8, max_tokens=6, rounds=1, num_compiles=10),
                   DecodeBench(SMALL_LLAMA, batches=(1, 4), context=32, timed_steps=3,
                               device="cpu"), budget_s=float("inf"))  # fmt: skip


@dataclass
class Run:
    """One run's state: where results go, the scratch folder, what the stages measured."""

    plan: Plan
    out: Path
    work: Path
    tokenizer: Path | None
    startup: dict[str, Any] = field(default_factory=dict)
    _model: Path | None = None

    def parity_model(self) -> Path:
        """The SmolLM2-shaped checkpoint, written once per run (its seconds in startup)."""
        if self._model is None:
            started = time.perf_counter()
            self._model = parity.write_parity_model(self.work / "smollm2-shape",
                                                    self.plan.parity_model, self.tokenizer)
            self.startup["checkpoint written (seeded random fp32 safetensors)"] = {
                "seconds": time.perf_counter() - started}
        return self._model


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder refused it (the tests make the GPU machine's absences so)
        return False


def stage_imports(run: Run) -> list[list[str]]:
    """A fresh process importing torch, triton and the engine (and initialising CUDA)."""
    code = ("import time; t = time.perf_counter(); import torch, triton; "
            "import iterserve.replica.llm_engine; "
            f"torch.cuda.init() if {run.plan.device == 'cuda'} else None; "
            "print(time.perf_counter() - t)")  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return [["imports", "fresh process", proc.stderr.strip()[-200:], "FAILED"]]
    total, imports = time.perf_counter() - started, float(proc.stdout.split()[-1])
    run.startup["process"] = {"imports_s": imports, "process_s": total}
    cuda = " + CUDA init" if run.plan.device == "cuda" else ""
    return [["startup", f"fresh process: import torch, triton, the engine{cuda}",
             f"{imports:.2f} s ({total:.2f} s with the interpreter's start)", "-"]]  # fmt: skip


def stage_parity(run: Run) -> list[list[str]]:
    return parity.stage_parity(run.parity_model(), run.plan.device, run.plan.num_tokens, run.startup)


def stage_kernel_bench(run: Run, budget_s: float) -> list[list[str]]:
    if not run.plan.run_gpu_stages:
        return [["kernel bench", "kernel_bench.py", "skipped in --dry-run (tests/kernels/"
                 "test_kernel_bench_smoke.py runs its code in the interpreter)", "-"]]  # fmt: skip
    from iterserve.loadtests.studies.gpu_first_light import kernel_bench

    args = ["--out", str(run.out / "kernel_bench.md"), "--budget-s", f"{budget_s:.0f}", "--skip-engine"]
    rc = kernel_bench.main(args)
    return [["kernel bench", f"kernel_bench.py --budget-s {budget_s:.0f} (floors)",
             f"exit code {rc}, table in kernel_bench.md", "ok" if rc == 0 else "FAILED"]]  # fmt: skip


def stage_engine_decode(run: Run) -> list[list[str]]:
    from iterserve.loadtests.studies.gpu_first_light import engine_decode_bench as bench

    copy_bw = bench.copy_bandwidth(run.plan.device)
    rows = bench.bench_engine_decode(copy_bw, run.plan.decode_bench)
    lines = [f"Copy bandwidth {copy_bw / 1e9:.0f} GB/s.", "", "| section | case | measured | floor | "
             "verdict |", "|---|---|---|---|---|"] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    (run.out / "engine_decode.md").write_text("\n".join(lines) + "\n")
    return [["engine decode", f"{row[0]}: {row[1]}", f"{row[2]} (floor {row[3]})",
             "FAILED" if row[4] == "BELOW FLOOR" else row[4]] for row in rows]  # fmt: skip


def stage_step_probe(run: Run) -> list[list[str]]:
    plan = run.plan
    return step_probe.stage_step_probe(run.out, plan.device, plan.probe_model, plan.probe_batches,
                                       plan.probe_prompt_lens, plan.probe_decode_steps, run.startup)


def stage_structured(run: Run) -> list[list[str]]:
    """Constrained vs free tokens/s on the SmolLM2-shaped model, and cold schema compiles.

    Random weights rarely close a JSON document, so validity is not judged here: CI checks it
    on the real built-in model (tests/unit/test_structured_builtin.py, 50/50 valid)."""
    if not installed("xgrammar"):
        return [["structured", "constrained vs free", "skipped: xgrammar is not installed (its "
                 "wheels travel in .gpu_carry/wheels: rehearse.py --prepare)", "-"]]  # fmt: skip
    from iterserve.loadtests.studies.structured_outputs import structured_bench
    from iterserve.replica import LLM

    plan, sizes = run.plan, run.plan.structured
    llm = LLM(str(run.parity_model()), dtype="bfloat16", device=plan.device, max_model_len=1024,
              max_num_seqs=sizes.batch, gpu_memory_utilization=0.5)  # fmt: skip
    pool = llm.engine.constrained.pool
    before = pool.stats()
    speed = structured_bench.overhead(llm, sizes.batch, sizes.max_tokens, sizes.rounds)
    ratio = speed["ratio_constrained_over_free"]
    after = pool.stats()
    requests = after.num_requests - before.num_requests
    hit_rate = (after.num_cache_hits - before.num_cache_hits) / requests if requests else 0.0
    compiles = structured_bench.compile_times(llm, sizes.num_compiles)
    if plan.run_gpu_stages:
        verdict = "ok" if ratio >= STRUCTURED_FLOOR else "FAILED"
    else:
        verdict = "- (a GPU floor)"
    vocab = llm.engine.tokenizer.vocab_size
    llm.engine.constrained.shutdown()  # the compile threads; the engine has no other
    del llm
    return [["structured overhead",
             f"batch {sizes.batch} x {sizes.max_tokens} tokens, moderately complex schema vs free, "
             f"A B rounds: {sizes.rounds}, tokenizer of {vocab} tokens; floor >= {STRUCTURED_FLOOR}x "
             "on the GPU",
             f"free {speed['free_tok_s']} tok/s, constrained {speed['constrained_tok_s']} tok/s: "
             f"**{ratio}x**; compile cache hit rate {hit_rate:.2f}; cold compile p50 "
             f"{compiles['p50_ms']} ms / p99 {compiles['p99_ms']} ms ({compiles['schemas']} schemas)",
             verdict]]  # fmt: skip


def stage_serve(run: Run) -> list[list[str]]:
    """One Ray Serve replica of the SmolLM2-shaped model on the GPU; one completion over HTTP."""
    if not installed("ray"):
        return [["serve", "Ray Serve replica, POST /v1/completions", f"skipped: ray is not "
                 f"installed, and its wheel ({RAY_WHEEL_MB} MB) is over the 64 MiB that can "
                 "travel to the GPU machine", "-"]]  # fmt: skip
    if not run.plan.run_gpu_stages:
        return [["serve", "Ray Serve replica on the GPU", "skipped in --dry-run", "-"]]
    import httpx
    import ray
    from ray import serve

    from iterserve.deploy.app import APP_NAME, build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8765})
        serve.run(build_app({"model": str(run.parity_model()), "num_gpus_per_replica": 1,
                             "gpu_memory_utilization": 0.5}), name=APP_NAME, route_prefix="/")  # fmt: skip
        start = time.perf_counter()
        body = {"prompt": parity.PROMPTS[0], "max_tokens": 8, "temperature": 0}
        response = httpx.post("http://127.0.0.1:8765/v1/completions", timeout=120, json=body)
        ok = response.status_code == 200 and bool(response.json()["choices"][0]["text"])
        return [["serve", "Ray Serve replica, POST /v1/completions",
                 f"HTTP {response.status_code} in {time.perf_counter() - start:.2f} s",
                 "ok" if ok else "FAILED"]]  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()


def run_stages(run: Run, names: tuple[str, ...]) -> list[list[str]]:
    plan, started = run.plan, time.perf_counter()
    rows: list[list[str]] = []
    times: dict[str, float] = {}

    def later_estimates(name: str) -> float:  # what the stages after this one need
        after = names[names.index(name) + 1 :]
        return sum(plan.estimate_s.get(n, 0.0) for n in after)

    stages: dict[str, Callable[[], list[list[str]]]] = {
        "imports": lambda: stage_imports(run),
        "parity": lambda: stage_parity(run),
        "kernel bench": lambda: stage_kernel_bench(run, max(30.0, left() - later_estimates("kernel bench"))),
        "engine decode": lambda: stage_engine_decode(run),
        "step probe": lambda: stage_step_probe(run),
        "structured": lambda: stage_structured(run),
        "serve": lambda: stage_serve(run),
    }

    def left() -> float:
        return plan.budget_s - (time.perf_counter() - started)

    for name in names:
        stage_started = time.perf_counter()
        if plan.estimate_s.get(name, 0.0) > left():
            rows.append([name, "skipped: time budget", f"{left():.0f} s left of {plan.budget_s:.0f} s, "
                         f"the stage takes ~{plan.estimate_s[name]:.0f} s", "-"])  # fmt: skip
        else:
            try:
                rows += stages[name]()
            except Exception as exc:  # a failed stage is a row in the report; the others still run
                rows.append([name, "raised", f"{type(exc).__name__}: {str(exc)[:300]}", "FAILED"])
        parity.release_memory(plan.device)
        times[name] = time.perf_counter() - stage_started
        write_report(run, rows, times, time.perf_counter() - started)
    return rows


def write_report(run: Run, rows: list[list[str]], times: dict[str, float], seconds: float) -> None:
    import triton

    device = torch.cuda.get_device_name(0) if run.plan.device == "cuda" else "cpu"
    lines = [f"{device}; python {sys.version.split()[0]}, torch {torch.__version__}, triton "
             f"{triton.__version__}", "", "| stage | what | measured | verdict |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("\nStage times: " + ", ".join(f"{name} {s:.1f} s" for name, s in times.items()) + ".")
    lines.append(f"Wall time {seconds:.0f} s (budget {run.plan.budget_s:.0f} s).")
    (run.out / "report.md").write_text("\n".join(lines) + "\n")
    (run.out / "startup.json").write_text(json.dumps(run.startup, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/first_light"),
                        help="folder for report.md and every stage's output")
    parser.add_argument("--dry-run", action="store_true", help="CPU, small settings (CI)")
    parser.add_argument("--budget-s", type=float, help="skip stages that would end past this "
                        "(default: 300 s on a GPU, none in --dry-run)")
    parser.add_argument("--tokenizer", type=Path, help="a folder with SmolLM2's tokenizer.json and "
                        "tokenizer_config.json for the parity model (default: the committed one)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated stages to run, in order (default: {','.join(STAGES)})")
    args = parser.parse_args(argv)
    names = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    if unknown := [n for n in names if n not in STAGES]:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_first_light needs a CUDA GPU (or --dry-run on CPU).", file=sys.stderr)
        return 2
    plan = Plan.dry_run() if args.dry_run else Plan.for_gpu()
    if args.budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="first-light-") as work:
        rows = run_stages(Run(plan, args.out, Path(work), args.tokenizer), names)
    print((args.out / "report.md").read_text())
    return 1 if any(row[-1] == "FAILED" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
