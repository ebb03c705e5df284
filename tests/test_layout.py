"""The shape of the house: imports go one way, collectives have one way down, modules stay small.

These read the source, not the behaviour. They keep the "Layout" map of docs/design.md true:

* the package's parts sit on floors (`PART_FLOORS`): ``_src``, then the public API
  (``replicator`` and its thin faces), then ``models/``, then ``cli/``; a module imports from
  another part only on a lower floor (so no ``_src`` module imports the public face, and
  nothing below the CLI imports it);
* the import graph of the whole package (``_src``, the public face, the models, the CLI),
  function-local imports included, has no cycle, so every module sits on a floor above
  everything it imports;
* ``_src``'s packages (``core``, ``optim``, ``report``, ``sharded``, ``distributed``,
  ``pipeline``, ``planner``, ``run``, and the ``context`` module that holds the Replicator) sit
  on floors too (`PACKAGE_FLOORS`), and so do the rooms of ``models/`` (`MODEL_FLOORS`): a module
  imports from another package only on a lower floor;
* a replica collective (``lax.psum`` and kin) is written only in ``collectives.py``; the pipeline
  engine writes its stage transfers (``lax.ppermute``) itself;
* no module of the package is over 500 lines, and no function over 80 lines, its docstring
  aside.

Each rule's checker is also run on a graph or a source that breaks it (``test_*_can_fail``),
so that a rule that no longer looks at anything fails.

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
    "sharded": 1,  # attention over `context`, experts over `expert`, their kernels
    "distributed": 1,  # initialize, heartbeat, the launcher
    "pipeline": 2,  # schedules and the scanned engine
    "context": 2,  # the Replicator
    "planner": 3,  # rp.plan
    "training": 3,  # rp.fit, checkpoints, logs
}
PART_FLOORS = {  # the package's parts, each above what it imports
    "_src": 0,  # the library
    "api": 1,  # the public face: replicator/__init__.py, attention, moe, pipeline, distributed
    "models": 2,  # the reference models users copy, on the public API
    "cli": 3,  # the `replicator` application (and `python -m replicator.launch`, its launcher)
}
MODEL_FLOORS = {  # models/' rooms, each above what it imports
    "config": 0,  # GPTConfig: the decoder's options (every family's)
    "families": 0,  # each Hugging Face family's config.json and names, one module each
    "text": 0,  # the built-in jobs' data
    "mlp": 0,  # the small reference models: MLP, and CNN on the layers' batch norm
    "layers": 1,  # the decoder's layers: norms, rotary, attention, MLP, experts (and batch norm)
    "hf": 1,  # Hugging Face checkpoints: config.json, safetensors read and written
    "cnn": 2,
    "decoder": 2,  # the assembly: init, block, apply, loss
    "placement": 3,  # on a mesh: roles, rules, place, ZeRO's stacking
    "pipelined": 3,  # the decoder as a pipeline's stages
    "sizes": 3,  # parameters, FLOPs, rp.planner.ModelShape
    "gpt": 4,  # the GPT's face: every name above, as `gpt.X`
    "llama": 5,  # the Llama family's face: configs from transformers', state dicts
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


def _part(name: str) -> str:
    """The part of the package a module belongs to (`PART_FLOORS`)."""
    if name == "replicator.launch":  # `python -m replicator.launch`: the CLI's launcher
        return "cli"
    second = name.split(".")[1] if name.count(".") else ""
    return second if second in ("_src", "models", "cli") else "api"


def _model_room(name: str) -> str:
    """The room of ``models/`` a module belongs to: its package, or itself at the root."""
    return name.split(".")[2] if name.count(".") >= 2 else ""


def wrong_imports(graph: dict, members: list[str], part, floors: dict) -> list[str]:
    """The imports of ``members`` (modules of ``graph``) that do not go down a floor: from one
    part (``part(name)``) to another whose floor (``floors``) is not lower. A package's own
    ``__init__`` (a module's parent) is not an import of it, except the root's: ``replicator``
    is the public face."""
    wrong = []
    for name in members:
        for dep in sorted(graph[name]):
            parent = name.startswith(dep + ".") and dep != "replicator"
            if parent or dep not in members:
                continue
            here, there = part(name), part(dep)
            if here != there and floors[there] >= floors[here]:
                wrong.append(
                    f"{name} (floor {floors[here]}) imports {dep} ({there}, floor {floors[there]})"
                )
    return wrong


def test_the_parts_import_only_lower_floors():
    wrong = wrong_imports(GRAPH, list(GRAPH), _part, PART_FLOORS)
    assert not wrong, "imports that do not go down a floor:\n" + "\n".join(wrong)


def test_the_models_rooms_import_only_lower_floors():
    models = [name for name in GRAPH if name.startswith("replicator.models.")]
    unplaced = sorted({_model_room(name) for name in models} - set(MODEL_FLOORS))
    assert not unplaced, f"rooms of models/ without a floor in MODEL_FLOORS: {unplaced}"
    wrong = wrong_imports(GRAPH, models, _model_room, MODEL_FLOORS)
    assert not wrong, "imports that do not go down a floor:\n" + "\n".join(wrong)


def test_the_floor_rules_can_fail():
    """An import up a floor (the public API importing models/, models/ importing the CLI, a
    layer importing a family's assembly) and a cycle are each found."""
    for name, dep in [
        ("replicator.pipeline", "replicator.models.gpt"),
        ("replicator.models.gpt", "replicator.cli.jobs"),
        ("replicator._src.core.mesh", "replicator"),
    ]:
        graph = {**GRAPH, name: GRAPH[name] | {dep}}
        assert wrong_imports(graph, list(graph), _part, PART_FLOORS), (name, dep)
    models = [name for name in GRAPH if name.startswith("replicator.models.")]
    graph = {**GRAPH, "replicator.models.layers.self_attention": {"replicator.models.decoder"}}
    assert wrong_imports(graph, models, _model_room, MODEL_FLOORS)
    cycle = {**GRAPH, "replicator.models.config": {"replicator.models.gpt"}}
    with pytest.raises(AssertionError, match="import cycle: replicator.models"):
        floors(cycle)


def floors(graph: dict | None = None) -> dict[str, int]:
    """Each module's floor: 0 if it imports no other module, else one above its highest import
    (in ``graph``, by default the package's).

    Raises ``AssertionError`` naming a cycle if there is one (the floors are then undefined).
    """
    graph = GRAPH if graph is None else graph
    floor: dict[str, int] = {}
    visiting: list[str] = []

    def visit(name: str) -> int:
        if name in floor:
            return floor[name]
        assert name not in visiting, "import cycle: " + " -> ".join(
            [*visiting[visiting.index(name) :], name]
        )
        visiting.append(name)
        deps = [d for d in graph[name] if not name.startswith(d + ".")]  # a package's parent
        floor[name] = 1 + max(map(visit, deps), default=-1)
        visiting.pop()
        return floor[name]

    for name in graph:  # the whole package: _src, the public face, the models and the CLI
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
    wrong = wrong_imports(GRAPH, src, _package, PACKAGE_FLOORS)
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


def long_modules(sources: dict[str, str]) -> list[str]:
    """The modules (name -> source) over `MODULE_LINES` lines."""
    lines = {name: len(text.splitlines()) for name, text in sources.items()}
    return [f"{name}: {n} lines" for name, n in lines.items() if n > MODULE_LINES]


def test_modules_are_small():
    """Every module of the package: ``_src``, the public face, ``models/`` and ``cli/``."""
    long = long_modules({name: path.read_text() for name, path in MODULES.items()})
    assert not long, f"modules over {MODULE_LINES} lines:\n" + "\n".join(long)


def long_functions(source: str) -> list[str]:
    """The functions of ``source`` over `FUNCTION_LINES` lines, docstrings aside."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = _function_lines(node)
            if lines > FUNCTION_LINES:
                long.append(f"{node.lineno} {node.name}: {lines} lines")
    return long


def test_the_size_rules_can_fail():
    body = "    x = 1\n" * (FUNCTION_LINES - 1)  # with the def line: at the limit
    source = f'def f():\n    """A docstring."""\n{body}\n\ndef g():\n{body}    return x\n'
    assert [where.split(" ", 1)[1] for where in long_functions(source)] == [
        f"g: {FUNCTION_LINES + 1} lines"
    ]
    assert long_modules({"m": "\n" * MODULE_LINES, "n": "\n" * (MODULE_LINES + 1)}) == [
        f"n: {MODULE_LINES + 1} lines"
    ]


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def test_functions_are_short():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{where}"
        for path in MODULES.values()
        for where in long_functions(path.read_text())
    ]
    assert not long, f"functions over {FUNCTION_LINES} lines, docstrings aside:\n" + "\n".join(long)
