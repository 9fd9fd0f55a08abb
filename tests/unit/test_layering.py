"""The rooms import one way: kernels <- replica <- dashboards <- autoscale <- autoscale.sim <-
deploy <- loadtests <- loadtests.studies.

Read from the source (ast), so a lazy import inside a function counts too. Inside autoscale
the router and autoscaler never import the simulator that drives them (autoscale/sim/);
nothing that ships (the library rooms and loadtests' own tools) imports a study
(loadtests/studies/); tests may import anything. And no two modules import each other,
directly or round a longer circle, outside `if TYPE_CHECKING:` blocks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The layers, lowest first: a module may import its own layer and those below it.
LAYERS = ["kernels", "replica", "dashboards", "autoscale", "autoscale.sim", "deploy", "loadtests",
          "loadtests.studies"]

# A module whose path says one layer but which belongs to another: the simulator's import path
# from before it moved, a re-export of autoscale/sim/cluster.py.
PLACED = {"iterserve.autoscale.cluster_sim": "autoscale.sim"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "iterserve." + ".".join(parts)


def layer_of(module: str) -> str | None:
    """The deepest layer a dotted module name falls in (None: not one of ours)."""
    if module in PLACED:
        return PLACED[module]
    found = None
    for layer in LAYERS:
        if module == f"iterserve.{layer}" or module.startswith(f"iterserve.{layer}."):
            found = layer
    return found


def library_files() -> list[Path]:
    rooms = {layer.split(".")[0] for layer in LAYERS}
    return sorted(p for room in rooms for p in (ROOT / room).rglob("*.py"))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for inner in ast.walk(node))
    return skipped


def imported_modules(path: Path, type_only: bool = True) -> set[str]:
    """Every iterserve module or name the file imports (type_only: also under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set() if type_only else _type_checking_nodes(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("iterserve.")}


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_layers_below_it(layer: str) -> None:
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    violations = []
    for path in library_files():
        if layer_of(module_name(path)) != layer:
            continue
        for name in imported_modules(path):
            other = layer_of(name)
            if other is not None and other not in allowed:
                violations.append(f"{path.relative_to(ROOT)} imports {name} ({other})")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_no_import_circles_outside_type_checking() -> None:
    modules = {module_name(p): p for p in library_files()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path, type_only=False):
            while imported and imported not in modules:  # a name inside a module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    circles = [cycle for cycle in _strongly_connected(graph) if len(cycle) > 1]
    assert not circles, f"import circles: {circles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively (the graph has a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def imported_module_paths(path: Path) -> set[str]:
    """The modules the file imports (`from M import n`: M; `import M`: M), ours only."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("iterserve.")}


def test_every_import_of_ours_names_a_module_that_exists() -> None:
    """Lazy imports too (a moved file leaves them pointing nowhere until they run)."""
    modules = {module_name(p) for p in library_files()}
    files = library_files() + sorted((ROOT / "tests").rglob("*.py"))
    dangling = [f"{path.relative_to(ROOT)} imports {name}" for path in files
                for name in sorted(imported_module_paths(path)) if name not in modules]
    assert not dangling, "imports of modules that do not exist:\n" + "\n".join(dangling)


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """The readers above catch what they are for (a file that breaks both rules)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from iterserve.loadtests.studies.router_tournament import tournament\n"
                   "def f() -> None:\n    import iterserve.autoscale.sim.cluster\n")
    names = imported_modules(bad)
    assert {layer_of(n) for n in names} == {"loadtests.studies", "autoscale.sim"}
    assert _strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"], ["c"]]
