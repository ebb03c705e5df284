"""The package's layout: imports go one way, collectives have one way down, modules stay small,
public functions take few parameters.

These read the source, not the behaviour. They keep the "Layout" map of docs/design.md true:

* the package's parts have levels (`PART_LEVELS`): ``_src``, then the public API
  (``replicator`` and its thin faces), then ``models/``, then ``cli/``; a module imports from
  another part only at a lower level (so no ``_src`` module imports the public face, and
  nothing below the CLI imports it);
* the import graph of the whole package (``_src``, the public face, the models, the CLI),
  function-local imports and imports under ``if TYPE_CHECKING:`` included (an annotation is a
  dependency too), has no cycle, so every module sits at a level above everything it imports;
* ``_src``'s packages (``core``, ``optim``, ``report``, ``sharded``, ``distributed``,
  ``pipeline``, ``planner``, ``training``, and the ``context`` module that holds the
  Replicator) have levels too (`PACKAGE_LEVELS`), and so do the packages and root modules of
  ``models/`` (`MODEL_LEVELS`): a module imports from another package only at a lower level;
* a replica collective (``lax.psum`` and kin) is written only in ``collectives.py``; the pipeline
  engine writes its stage transfers (``lax.ppermute``) itself;
* no module of the package is over 500 lines, and no function over 80 lines, its docstring
  aside; no public function or method takes more than 10 parameters (options go in records).

Each rule's checker is also run on a graph or a source that breaks it (``test_*_can_fail``),
so that a rule that no longer looks at anything fails.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import re
import types

import pytest
import test_api

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "replicator"
MODULE_LINES = 500
FUNCTION_LINES = 80
PACKAGE_LEVELS = {  # _src's packages (and its root module), each above what it imports
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
PART_LEVELS = {  # the package's parts, each above what it imports
    "_src": 0,  # the library
    "api": 1,  # the public face: replicator/__init__.py, attention, moe, pipeline, distributed
    "models": 2,  # the reference models users copy, on the public API
    "cli": 3,  # the `replicator` application (and `python -m replicator.launch`, its launcher)
}
MODEL_LEVELS = {  # models/' packages and root modules, each above what it imports
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
    "generation": 4,  # text from the decoder with a key/value cache: generate
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


def imports_of(source: str) -> set[str]:
    """Every ``replicator`` module that ``source`` imports, at any depth of its code, under
    ``if TYPE_CHECKING:`` too."""
    found = set()
    for node in ast.walk(ast.parse(source)):
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


GRAPH = {name: imports_of(path.read_text()) - {name} for name, path in MODULES.items()}


def test_an_import_for_annotations_only_is_an_edge_too():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from replicator.cli.config.train import TrainConfig\n"
    )
    assert imports_of(source) == {"replicator.cli.config.train"}
    cycle = {
        **GRAPH,
        "replicator.cli.config.sections": GRAPH["replicator.cli.config.sections"]
        | imports_of(source),
    }
    with pytest.raises(AssertionError, match="import cycle"):
        levels(cycle)


def _part(name: str) -> str:
    """The part of the package a module belongs to (`PART_LEVELS`)."""
    if name == "replicator.launch":  # `python -m replicator.launch`: the CLI's launcher
        return "cli"
    second = name.split(".")[1] if name.count(".") else ""
    return second if second in ("_src", "models", "cli") else "api"


def _model_unit(name: str) -> str:
    """The package or module of ``models/`` a module belongs to: its package, or itself at
    the root."""
    return name.split(".")[2] if name.count(".") >= 2 else ""


def wrong_imports(graph: dict, members: list[str], part, level_of: dict) -> list[str]:
    """The imports of ``members`` (modules of ``graph``) that do not go down a level: from one
    part (``part(name)``) to another whose level (``level_of``) is not lower. A package's own
    ``__init__`` (a module's parent) is not an import of it, except the root's: ``replicator``
    is the public face."""
    wrong = []
    for name in members:
        for dep in sorted(graph[name]):
            parent = name.startswith(dep + ".") and dep != "replicator"
            if parent or dep not in members:
                continue
            here, there = part(name), part(dep)
            if here != there and level_of[there] >= level_of[here]:
                wrong.append(
                    f"{name} (level {level_of[here]}) imports {dep} ({there}, level {level_of[there]})"
                )
    return wrong


def test_the_parts_import_only_lower_levels():
    wrong = wrong_imports(GRAPH, list(GRAPH), _part, PART_LEVELS)
    assert not wrong, "imports that do not go down a level:\n" + "\n".join(wrong)


def test_the_models_packages_import_only_lower_levels():
    models = [name for name in GRAPH if name.startswith("replicator.models.")]
    unplaced = sorted({_model_unit(name) for name in models} - set(MODEL_LEVELS))
    assert not unplaced, (
        f"packages and modules of models/ without a level in MODEL_LEVELS: {unplaced}"
    )
    wrong = wrong_imports(GRAPH, models, _model_unit, MODEL_LEVELS)
    assert not wrong, "imports that do not go down a level:\n" + "\n".join(wrong)


def test_the_level_rules_can_fail():
    """An import up a level (the public API importing models/, models/ importing the CLI, a
    layer importing a family's assembly) and a cycle are each found."""
    for name, dep in [
        ("replicator.pipeline", "replicator.models.gpt"),
        ("replicator.models.gpt", "replicator.cli.jobs"),
        ("replicator._src.core.mesh", "replicator"),
    ]:
        graph = {**GRAPH, name: GRAPH[name] | {dep}}
        assert wrong_imports(graph, list(graph), _part, PART_LEVELS), (name, dep)
    models = [name for name in GRAPH if name.startswith("replicator.models.")]
    graph = {**GRAPH, "replicator.models.layers.self_attention": {"replicator.models.decoder"}}
    assert wrong_imports(graph, models, _model_unit, MODEL_LEVELS)
    cycle = {**GRAPH, "replicator.models.config": {"replicator.models.gpt"}}
    with pytest.raises(AssertionError, match="import cycle: replicator.models"):
        levels(cycle)


def levels(graph: dict | None = None) -> dict[str, int]:
    """Each module's level: 0 if it imports no other module, else one above its highest import
    (in ``graph``, by default the package's).

    Raises ``AssertionError`` naming a cycle if there is one (the levels are then undefined).
    """
    graph = GRAPH if graph is None else graph
    level: dict[str, int] = {}
    visiting: list[str] = []

    def visit(name: str) -> int:
        if name in level:
            return level[name]
        assert name not in visiting, "import cycle: " + " -> ".join(
            [*visiting[visiting.index(name) :], name]
        )
        visiting.append(name)
        deps = [d for d in graph[name] if not name.startswith(d + ".")]  # a package's parent
        level[name] = 1 + max(map(visit, deps), default=-1)
        visiting.pop()
        return level[name]

    for name in graph:  # the whole package: _src, the public face, the models and the CLI
        visit(name)
    return level


def test_the_package_imports_form_levels_without_a_cycle():
    assert levels()


def _package(name: str) -> str:
    """The part of ``_src`` a module belongs to: its package, or itself at ``_src``'s root."""
    return name.split(".")[2]


def test_src_packages_import_only_lower_levels():
    src = [name for name in GRAPH if name.count(".") >= 2 and name.startswith("replicator._src.")]
    unplaced = sorted({_package(name) for name in src} - set(PACKAGE_LEVELS))
    assert not unplaced, f"packages of _src without a level in PACKAGE_LEVELS: {unplaced}"
    wrong = wrong_imports(GRAPH, src, _package, PACKAGE_LEVELS)
    assert not wrong, "imports that do not go down a level:\n" + "\n".join(wrong)


def test_src_root_holds_packages_and_the_replicator_only():
    root = sorted(p.name for p in (PACKAGE / "_src").glob("*.py"))
    assert root == ["__init__.py", "context.py"], root


def shared_package_names(package: pathlib.Path) -> list[str]:
    """The names that more than one package below ``package`` has."""
    names = [init.parent.name for init in package.rglob("__init__.py")]
    return sorted({n for n in names if names.count(n) > 1})


def test_no_two_packages_share_a_name():
    assert not shared_package_names(PACKAGE)


def test_the_package_name_rule_can_fail(tmp_path):
    for package in ["a/layers", "b/layers", "b/other"]:
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    assert shared_package_names(tmp_path) == ["layers"]


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


PARAMETERS = 10
# the public modules (test_api's list): every function, class and method they export
FACES = test_api.FACES


def _parameters(fn) -> int:
    """``fn``'s parameters, ``self`` and ``cls`` aside (``*args`` and ``**kwargs`` count one)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature
        return 0
    return len([name for name in signature.parameters if name not in ("self", "cls")])


def long_signatures(module) -> list[str]:
    """The public functions, methods and hand-written ``__init__`` of ``module``'s public names
    that take more than `PARAMETERS` parameters (a dataclass's fields are its record)."""
    found = {}
    for name in dir(module):
        obj = getattr(module, name)
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        if inspect.isfunction(obj):
            found[name] = _parameters(obj)
        elif inspect.isclass(obj):
            members = dict(vars(obj))
            if dataclasses.is_dataclass(obj):
                members.pop("__init__", None)
            for attr, member in members.items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                member = getattr(member, "__func__", member)  # static and class methods
                if inspect.isfunction(member):
                    found[f"{name}.{attr}"] = _parameters(member)
    return [
        f"{module.__name__}.{name}: {n} parameters"
        for name, n in sorted(found.items())
        if n > PARAMETERS
    ]


def test_public_functions_take_at_most_10_parameters():
    long = [line for face in FACES for line in long_signatures(importlib.import_module(face))]
    assert not long, (
        f"public functions over {PARAMETERS} parameters (group options in records):\n"
        + "\n".join(long)
    )


def test_the_parameter_rule_can_fail(tmp_path, monkeypatch):
    args = ", ".join(f"a{i}" for i in range(PARAMETERS))
    (tmp_path / "wide_face.py").write_text(
        f"def ten({args}): pass\n"
        f"def eleven({args}, extra): pass\n"
        f"class C:\n"
        f"    def __init__(self, {args}, extra): pass\n"
        f"    def method(self, {args}): pass\n"
        f"    @staticmethod\n"
        f"    def wide(*args, {args}, **kwargs): pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert long_signatures(importlib.import_module("wide_face")) == [
        f"wide_face.C.__init__: {PARAMETERS + 1} parameters",
        f"wide_face.C.wide: {PARAMETERS + 2} parameters",
        f"wide_face.eleven: {PARAMETERS + 1} parameters",
    ]
