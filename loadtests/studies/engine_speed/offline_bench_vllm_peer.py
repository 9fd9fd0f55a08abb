"""vLLM's CPU build as a peer of the offline benchmark: the side that runs in iterserve's venv.

It writes what vLLM needs (an fp32 checkpoint of the served model, the workload as JSON), runs
offline_bench_vllm.py with the interpreter of vLLM's own venv once per round, and reads back
the result line and the cores vLLM's log says its compute threads were bound to.

vLLM's CPU settings, from its CPU install guide, given through its documented environment:
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache), VLLM_CPU_OMP_THREADS_BIND (the cores its OpenMP
compute threads bind to; "auto" binds every core but the ones it reserves for the engine
process, which on this 2-core x86 box leaves one compute thread), and LD_PRELOAD of tcmalloc
and Intel OpenMP (the latter makes vLLM set KMP_AFFINITY to the bound cores, KMP_BLOCKTIME=5,
KMP_TPAUSE=0).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from iterserve.loadtests.studies.engine_speed.offline_bench_hf import ThroughputResult
from iterserve.replica.model_source import is_gguf

if TYPE_CHECKING:
    from iterserve.autoscale.sim.workload import WorkloadRequest

VLLM_SCRIPT = Path(__file__).with_name("offline_bench_vllm.py")
VLLM_KV_CACHE_GIB = "3"  # as the engine runs: every running request's context fits
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # apt libtcmalloc-minimal4
RESULT_PREFIX = '{"seconds"'
# vLLM's engine logs "local_rank=0, core ids=[0, 1]" when it binds its worker's OpenMP threads.
CORE_IDS = re.compile(r"local_rank=0, core ids=\[([0-9, ]*)\]")


@dataclass(frozen=True)
class VllmSetup:
    """One vLLM arm: a name for the table and its thread binding (None: vLLM's "auto")."""

    name: str
    threads_bind: str | None


def vllm_cpu_preload(python: str) -> str:
    """vLLM's recommended CPU preload: tcmalloc and Intel OpenMP (vllm-cpu ships libiomp5 in
    its venv), each where present."""
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    return ":".join(str(p) for p in (TCMALLOC, iomp) if p.exists())


def prepare_vllm_inputs(hf: Any, model_path: Path, workload: list[WorkloadRequest],
                        folder: Path) -> tuple[Path, Path]:
    """The fp32 checkpoint transformers built from the served file (vLLM's CPU build has no
    GGUF kernels, and fp32 is what every other contender runs) plus its tokenizer, and the
    workload as JSON, for offline_bench_vllm.py in vLLM's own venv."""
    from transformers import AutoTokenizer

    model_dir, workload_file = folder / "model", folder / "workload.json"
    if not (model_dir / "config.json").exists():
        plain_checkpoint(hf).save_pretrained(model_dir)
        if is_gguf(model_path):
            tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent),
                                                      gguf_file=model_path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        tokenizer.save_pretrained(model_dir)
    workload_file.write_text(json.dumps(
        [{"prompt_token_ids": w.prompt_token_ids, "max_tokens": w.max_tokens} for w in workload]))
    return model_dir, workload_file


def plain_checkpoint(hf: Any) -> Any:
    """The same weights in a model transformers will save: one loaded from GGUF is marked
    quantized (by its loader) and refuses `save_pretrained`, though its tensors are fp32."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf.state_dict())
    return plain


def parse_vllm_run(stdout: str) -> tuple[dict[str, Any], list[int]]:
    """(the result offline_bench_vllm.py printed, the cores vLLM bound its compute threads to).

    vLLM's processes log to the same stdout, before the result and at shutdown after it, so
    the result is the line that starts as the script's JSON does; the cores come from vLLM's
    own binding log, not from what was asked."""
    results = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not results:
        raise RuntimeError(f"vLLM CPU printed no result:\n{stdout[-2000:]}")
    cores = CORE_IDS.search(stdout)
    if cores is None:
        raise RuntimeError("vLLM CPU did not log its OpenMP thread binding (core ids)")
    return json.loads(results[-1]), [int(c) for c in cores.group(1).split(",") if c.strip()]


def vllm_cpu(python: str, model_dir: Path, workload_file: Path, concurrency: int,
             max_batched_tokens: int, setup: VllmSetup,
             max_model_len: int = 2048) -> ThroughputResult:
    """One round of vLLM's CPU build in its own interpreter, bound as `setup` says."""
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB,
                        "LD_PRELOAD": vllm_cpu_preload(python)}
    if setup.threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = setup.threads_bind
    done = subprocess.run(
        [python, str(VLLM_SCRIPT), "--model-dir", str(model_dir), "--workload",
         str(workload_file), "--concurrency", str(concurrency),
         "--max-batched-tokens", str(max_batched_tokens), "--max-model-len", str(max_model_len)],
        env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM CPU failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result, cores = parse_vllm_run(done.stdout)
    bind = setup.threads_bind or "auto"
    return ThroughputResult(f"vLLM CPU {result['version']}, {setup.name} (bind {bind}: "
                            f"compute on cores {cores})",
                            result["seconds"], result["output_tokens"], len(cores))
