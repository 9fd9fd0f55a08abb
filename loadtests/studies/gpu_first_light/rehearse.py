"""Rehearse the GPU first light on CPU, on the software of the GPU machine the project borrows.

    python -m iterserve.loadtests.studies.gpu_first_light.rehearse --prepare   # the carry only
    python -m iterserve.loadtests.studies.gpu_first_light.rehearse [--fresh] [--out DIR]

--prepare writes .gpu_carry/ (git-ignored), all that the GPU call carries beside the tree:
wheels/ (gpu_machine.BROUGHT, built for that machine: CPython 3.12, manylinux x86-64) and
smollm2/ (SmolLM2-135M-Instruct's tokenizer, exported from the built-in GGUF, 3.5 MB). It
prints every size and the working tree's (tracked and untracked-not-ignored files, what the
device tool sends), and fails if together they pass the 64 MiB limit.

The rehearsal then builds a venv holding only what that machine has: python3.12 where a CPU
torch installs for it (else this interpreter's version, said so), torch's CPU build standing
in for 2.11 (gpu_machine.TORCH_STAND_IN), triton 3.6.0, transformers 5.17.0 and the other
pinned versions (a pin with no build for this Python is loosened, said so), nothing of
gpu_machine.MISSING. It runs scripts/gpu_first_light.sh there with --dry-run, the very
script the GPU runs, and prints the report with each stage's wall time.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from iterserve.loadtests.studies.gpu_first_light.gpu_machine import (
    BROUGHT,
    CARRY_LIMIT_BYTES,
    MISSING,
    PYTHON,
    TORCH_STAND_IN,
    VERSIONS,
)
from iterserve.replica.make_model import cache_root

REPO = Path(__file__).resolve().parents[3]
CARRY = REPO / ".gpu_carry"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
# What the stages need there, beside torch and triton (all on the machine).
NEEDED = ("transformers", "tokenizers", "safetensors", "numpy", "huggingface-hub", "jinja2", "pyyaml")


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False, **kwargs)


def download_wheels(dest: Path, python_version: str | None) -> list[Path]:
    """BROUGHT as wheels, for `python_version` (e.g. "3.12") on manylinux x86-64, or for this
    interpreter when None (the rehearsal's own twin of the carried set)."""
    shutil.rmtree(dest, ignore_errors=True)  # an earlier run's other versions: two of one name stop pip
    target: list[str] = []
    if python_version is not None:
        target = ["--python-version", python_version, "--implementation", "cp"]
        for platform in PLATFORMS:
            target += ["--platform", platform]
    proc = _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 "--dest", str(dest), *target, *BROUGHT])  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"pip download of {', '.join(BROUGHT)} failed:\n{proc.stderr[-2000:]}")
    return sorted(dest.glob("*.whl"))


def export_smollm2_tokenizer(dest: Path) -> Path:
    from iterserve.replica.model_source import builtin_model_path
    from iterserve.replica.tokenizer import Tokenizer
    from iterserve.replica.tokenizer_export import export_tokenizer

    return export_tokenizer(Tokenizer.from_pretrained(builtin_model_path()), dest)


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what the device tool sends: tracked files and untracked ones git does not ignore."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo)
    paths = {repo / p for p in listed.stdout.split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def size_report(tree: int, carried: dict[str, int]) -> tuple[list[str], bool]:
    """Lines naming every size in MiB, and whether all of it fits the device tool's limit."""
    total = tree + sum(carried.values())
    lines = [f"  {name:64s} {size / 2**20:7.2f} MiB" for name, size in sorted(carried.items())]
    lines.append(f"  {'working tree (git ls-files -co --exclude-standard)':64s} {tree / 2**20:7.2f} MiB")
    fits = total <= CARRY_LIMIT_BYTES
    lines.append(f"  {'together':64s} {total / 2**20:7.2f} MiB of {CARRY_LIMIT_BYTES / 2**20:.0f} MiB: "
                 + ("fits" if fits else "DOES NOT FIT"))  # fmt: skip
    return lines, fits


def prepare(carry: Path = CARRY) -> bool:
    wheels = download_wheels(carry / "wheels", PYTHON)
    export_smollm2_tokenizer(carry / "smollm2")
    carried = {f"{carry.name}/wheels/{w.name}": w.stat().st_size for w in wheels}
    carried[f"{carry.name}/smollm2 (SmolLM2-135M's tokenizer)"] = folder_bytes(carry / "smollm2")
    lines, fits = size_report(tree_bytes(), carried)
    print("What travels to the GPU machine:\n" + "\n".join(lines))
    return fits


def python_for_rehearsal() -> tuple[str, str]:
    """python3.12 (the GPU machine's) if this machine has it and a CPU torch installs for it;
    else this interpreter's version. Returns (executable, why)."""
    pyenv = Path.home() / ".pyenv" / "versions"
    found = [shutil.which(f"python{PYTHON}"), *glob.glob(f"{pyenv}/{PYTHON}*/bin/python{PYTHON}")]
    for candidate in filter(None, found):
        if _run([candidate, "--version"]).returncode != 0:
            continue
        probe = _run([candidate, "-m", "pip", "download", "--quiet", "--no-deps", "--dest",
                      str(cache_root() / "rehearsal-probe"), f"torch=={TORCH_STAND_IN}"])  # fmt: skip
        if probe.returncode == 0:
            return candidate, f"python {PYTHON}, the GPU machine's"
        reason = f"no CPU torch {TORCH_STAND_IN} for python {PYTHON} here"
        break
    else:
        reason = f"no python {PYTHON} here"
    base = getattr(sys, "_base_executable", sys.executable)
    return base, f"python {sys.version.split()[0]} ({reason})"


def pip_install(python: Path, specs: list[str]) -> list[str]:
    """Install, loosening any pin with no build for this Python; returns what was loosened."""
    loosened: list[str] = []
    while True:
        proc = _run([str(python), "-m", "pip", "install", "--quiet", *specs])
        if proc.returncode == 0:
            return loosened
        missing = re.search(r"No matching distribution found for ([\w.-]+)==", proc.stderr)
        if missing is None:
            raise SystemExit(f"pip install failed in {python}:\n{proc.stderr[-2000:]}")
        name = missing.group(1)
        loosened += [s for s in specs if s.split("==")[0].lower() == name.lower()]
        specs = [name if s.split("==")[0].lower() == name.lower() else s for s in specs]


def build_venv(venv: Path, fresh: bool) -> str:
    """The venv of the GPU machine's software (reused when its stamp matches). Returns a note."""
    stamp = venv / "rehearsal.stamp"
    want = repr((BROUGHT, VERSIONS, TORCH_STAND_IN, NEEDED))
    if fresh and venv.exists():
        shutil.rmtree(venv)
    if stamp.exists() and stamp.read_text() == want:
        return stamp.with_name("rehearsal.note").read_text()
    python, why = python_for_rehearsal()
    shutil.rmtree(venv, ignore_errors=True)
    if _run([python, "-m", "venv", str(venv)]).returncode != 0:
        raise SystemExit(f"{python} -m venv {venv} failed")
    specs = [f"torch=={TORCH_STAND_IN}", f"triton=={VERSIONS['triton']}"]
    specs += [f"{name}=={VERSIONS[name]}" if name in VERSIONS else name for name in NEEDED]
    loosened = pip_install(venv / "bin" / "python", specs)
    note = why + (f"; loosened (no build for it): {', '.join(loosened)}" if loosened else "")
    stamp.with_name("rehearsal.note").write_text(note)
    stamp.write_text(want)
    return note


def carry_for(venv: Path) -> Path:
    """The carry as the venv's Python installs it: .gpu_carry itself on python 3.12, else the
    same pinned wheels built for the venv's Python beside the same tokenizer."""
    version = _run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"])
    if version.stdout.strip() == str(tuple(int(x) for x in PYTHON.split("."))):
        return CARRY
    twin = venv / "carry"
    proc = _run([str(venv / "bin" / "python"), "-m", "pip", "download", "--quiet", "--no-deps",
                 "--only-binary=:all:", "--dest", str(twin / "wheels"), *BROUGHT])  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"pip download for the venv failed:\n{proc.stderr[-2000:]}")
    if not (twin / "smollm2").exists():
        (twin / "smollm2").symlink_to(CARRY / "smollm2")
    return twin


def installed(venv: Path) -> dict[str, str]:
    listing = _run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"])
    pairs = (line.split("==") for line in listing.stdout.splitlines() if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="only write .gpu_carry and check sizes")
    parser.add_argument("--venv", type=Path, default=cache_root() / "rehearsal-venv",
                        help="the GPU machine's software, as a venv (reused unless --fresh)")
    parser.add_argument("--fresh", action="store_true", help="rebuild the venv from nothing")
    parser.add_argument("--out", type=Path, default=Path("runs/rehearsal"), help="the dry run's output")
    args = parser.parse_args(argv)
    if not prepare():
        return 1
    if args.prepare:
        return 0
    started = time.perf_counter()
    note = build_venv(args.venv, args.fresh)
    packages = installed(args.venv)
    print(f"venv {args.venv} ({time.perf_counter() - started:.0f} s): {note}")
    print("  " + ", ".join(f"{n} {packages.get(n, '-')}" for n in ("torch", "triton", *NEEDED)))
    brought = {re.split(r"[=<>]", s)[0] for s in BROUGHT}
    extra = sorted(n for n in MISSING if n in packages and n not in brought)
    if extra:
        print(f"the venv holds what the GPU machine lacks: {extra}", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}  # fmt: skip
    env.update(PYTHON=str(args.venv / "bin" / "python"), GPU_CARRY=str(carry_for(args.venv)))
    started = time.perf_counter()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_first_light.sh"), str(args.out), "--dry-run"],
                          env=env, cwd=REPO, check=False)  # fmt: skip
    print(f"rehearsal: exit code {proc.returncode} after {time.perf_counter() - started:.0f} s")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
