"""The shape of the house: imports go one way, collectives have one way down, modules stay small.

These read the source, not the behaviour. They keep the "Layout" map of docs/design.md true:

* no ``_src`` module imports the public face (``replicator``, ``replicator.models``, ...);
* the import graph of the whole package (``_src``, the public face, the CLI), function-local
  imports included, has no cycle, so every module sits on a floor above everything it imports;
* ``_src``'s packages (``core``, ``optim``, ``report``, ``layers``, ``distributed``,
  ``pipeline``, ``planner``, ``run``, and the ``context`` module that holds the Replicator) sit
  on floors too (`PACKAGE_FLOORS`): a module imports from another package only on a lower floor;
* a replica collective (``lax.psum`` and kin) is written only in ``collectives.py``; the pipeline
  engine writes its stage transfers (``lax.ppermute``) itself;
* no ``_src`` module is over 500 lines, and no function in the package over 80 lines, its
  docstring aside.

An import under ``if TYPE_CHECKING:`` runs no code and makes no edge (annotations only).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "replicator"
MODULE_LINES = 500
FUNCTION_LINES = 80
PACKAGE_FLOORS = {  # _src's packages (and its root module), each above what it imports
    "core": 0,  # the Binding, mesh, leaf specs, collectives, lowering, step cache, tracing notes
    "optim": 1,  # wrap_optimizer's chain and ZeRO
    "report": 1,  # compiled programs read: hlo, StepReport
    "layers": 1,  # attention over `context`, experts over `expert`
    "distributed": 1,  # initialize, heartbeat, the launcher
    "pipeline": 2,  # schedules and the scanned engine
    "context": 2,  # the Replicator
    "planner": 3,  # rp.plan
    "run": 3,  # rp.fit, checkpoints, logs
}
COLLECTIVE = re.compile(r"lax\.(psum|pmean|all_gather|psum_scatter|ppermute|all_to_all)\b")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: pathlib.Path) -> set[str]:
    """Every ``replicator`` module that ``path`` imports, at any depth of its code."""
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # the nodes inside `if TYPE_CHECKING:` blocks
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `from pkg import name` may name a function
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _is_public_face(name: str) -> bool:
    return not name.startswith("replicator._src")


def test_no_src_module_imports_the_public_face():
    wrong = {
        name: sorted(filter(_is_public_face, deps))
        for name, deps in GRAPH.items()
        if name.startswith("replicator._src") and any(map(_is_public_face, deps))
    }
    assert not wrong, f"_src modules importing the public face: {wrong}"


def floors() -> dict[str, int]:
    """Each module's floor: 0 if it imports no other module, else one above its highest import.

    Raises ``AssertionError`` naming a cycle if there is one (the floors are then undefined).
    """
    floor: dict[str, int] = {}
    visiting: list[str] = []

    def visit(name: str) -> int:
        if name in floor:
            return floor[name]
        assert name not in visiting, "import cycle: " + " -> ".join(
            [*visiting[visiting.index(name) :], name]
        )
        visiting.append(name)
        deps = [d for d in GRAPH[name] if not name.startswith(d + ".")]  # a package's parent
        floor[name] = 1 + max(map(visit, deps), default=-1)
        visiting.pop()
        return floor[name]

    for name in GRAPH:  # the whole package: _src, the public face and the CLI
        visit(name)
    return floor


def test_src_imports_form_floors_without_a_cycle():
    assert floors()


def _package(name: str) -> str:
    """The part of ``_src`` a module belongs to: its package, or itself at ``_src``'s root."""
    return name.split(".")[2]


def test_src_packages_import_only_lower_floors():
    src = [name for name in GRAPH if name.count(".") >= 2 and name.startswith("replicator._src.")]
    unplaced = sorted({_package(name) for name in src} - set(PACKAGE_FLOORS))
    assert not unplaced, f"packages of _src without a floor in PACKAGE_FLOORS: {unplaced}"
    wrong = []
    for name in src:
        for dep in GRAPH[name]:
            if not dep.startswith("replicator._src.") or name.startswith(dep + "."):
                continue
            here, there = _package(name), _package(dep)
            if here != there and PACKAGE_FLOORS[there] >= PACKAGE_FLOORS[here]:
                wrong.append(
                    f"{name} (floor {PACKAGE_FLOORS[here]}) imports {dep} ({there}, "
                    f"floor {PACKAGE_FLOORS[there]})"
                )
    assert not wrong, "imports that do not go down a floor:\n" + "\n".join(wrong)


def test_src_root_holds_packages_and_the_replicator_only():
    root = sorted(p.name for p in (PACKAGE / "_src").glob("*.py"))
    assert root == ["__init__.py", "context.py"], root


def test_replica_collectives_are_written_only_in_the_collectives_layer():
    wrong = []
    for name, path in MODULES.items():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in COLLECTIVE.finditer(line):
                if name == "replicator._src.core.collectives":
                    continue
                if name.startswith("replicator._src.pipeline") and match[1] == "ppermute":
                    continue  # the engine's stage transfers
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not wrong, "lax collectives outside collectives.py:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "name", [n for n in MODULES if n.startswith("replicator._src")], ids=lambda n: n[15:] or "_src"
)
def test_src_modules_are_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MODULE_LINES, f"{MODULES[name]}: {lines} lines (at most {MODULE_LINES})"


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def test_functions_are_short():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = _function_lines(node)
                if lines > FUNCTION_LINES:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    long.append(f"{where} {node.name}: {lines} lines")
    assert not long, f"functions over {FUNCTION_LINES} lines, docstrings aside:\n" + "\n".join(long)
