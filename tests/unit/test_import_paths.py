"""Every import path users were given still imports: the ones the Serve configs, the KubeRay
manifest, the README, the benchmark and reliability reports and the studies' READMEs name
today, and the ones they named before files moved (issue 36).

A path is `module:attribute`, `module.attribute` or `module` (e.g. `python -m module`); it
resolves when the longest importable prefix is a module and the rest are its attributes.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [*sorted((ROOT / "deploy/configs").glob("*.yaml")),
             *sorted((ROOT / "deploy/kuberay").glob("*.yaml")), ROOT / "README.md",
             ROOT / "BENCHMARKS.md", ROOT / "BENCHMARKS_SERVING.md", ROOT / "RELIABILITY.md",
             *sorted((ROOT / "loadtests/studies").glob("**/README.md"))]
# Published before issue 36 moved their files; kept as re-exports.
BEFORE_THE_MOVE = [
    "iterserve.autoscale.policy:KVAutoscalingPolicy",
    "iterserve.autoscale.router:KVAwareRouter",
    "iterserve.autoscale.cluster_sim.simulate",
    "iterserve.deploy.app:build_app",
    "iterserve.replica:LLM",
]
# Words of that shape that are not import paths: an entry-point group, a dashboard file.
NOT_PATHS = {"iterserve.commands", "iterserve.json"}
PATH = re.compile(r"iterserve(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?::[A-Za-z_][A-Za-z0-9_]*)?")


def written_paths() -> list[str]:
    found: set[str] = set()
    for document in DOCUMENTS:
        found.update(PATH.findall(document.read_text()))
    found.update(f"{module}:{name}" for module, name in re.findall(
        r"from (iterserve[\w.]*) import (\w+)", (ROOT / "README.md").read_text()))
    return sorted(found - NOT_PATHS)


def resolve(path: str) -> object:
    module_path, _, attribute = path.partition(":")
    parts = module_path.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in [*parts[cut:], *([attribute] if attribute else [])]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(path)


def test_the_documents_name_some_paths() -> None:
    paths = written_paths()
    assert "iterserve.autoscale.router:KVAwareRouter" in paths
    assert any(p.startswith("iterserve.autoscale.autoscaling_policy") for p in paths)
    assert len(paths) > 20


@pytest.mark.parametrize("path", written_paths() + BEFORE_THE_MOVE)
def test_every_published_path_imports(path: str) -> None:
    assert resolve(path) is not None
