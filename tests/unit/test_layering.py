"""The rooms import one way: kernels <- replica <- dashboards <- autoscale <- deploy <- loadtests.

Read from the source (ast), so a lazy import inside a function counts too. A library room
never imports a benchmark or an experiment (loadtests); tests may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["kernels", "replica", "dashboards", "autoscale", "deploy", "loadtests"]


def imported_rooms(path: Path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "iterserve" and len(parts) > 1 and parts[1] in ORDER:
                rooms.add(parts[1])
    return rooms


@pytest.mark.parametrize("room", ORDER)
def test_a_room_imports_only_rooms_below_it(room: str) -> None:
    allowed = set(ORDER[: ORDER.index(room) + 1])
    violations = []
    for path in sorted((ROOT / room).rglob("*.py")):
        for other in imported_rooms(path) - allowed:
            violations.append(f"{path.relative_to(ROOT)} imports iterserve.{other}")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)
