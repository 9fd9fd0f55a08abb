"""The lint step's dead-code check (scripts/deadcode.py) finds what nothing outside the tests
uses, and passes on this tree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def deadcode() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deadcode", ROOT / "scripts/deadcode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["deadcode"] = module
    spec.loader.exec_module(module)
    return module


def test_an_unused_function_is_reported_and_a_study_counts_as_a_user(tmp_path: Path) -> None:
    (tmp_path / "replica").mkdir()
    (tmp_path / "replica/engine.py").write_text(
        "def used_by_a_study() -> int:\n    return 1\n\n\n"
        "def used_by_nothing() -> int:\n    return 2\n")
    (tmp_path / "loadtests/studies/some_study").mkdir(parents=True)
    (tmp_path / "loadtests/studies/some_study/probe.py").write_text(
        "from iterserve.replica.engine import used_by_a_study\n"
        "def never_called() -> int:\n    return used_by_a_study()\n")
    found = deadcode().unused(tmp_path)
    assert found == ["replica/engine.py:5: unused function 'used_by_nothing'"]


def test_this_tree_has_no_dead_code() -> None:
    module = deadcode()
    assert module.unused() == []
    assert len(module.ALLOWED) <= 16  # the "about 15": each one says why it stays
