"""The package's layers, read from the source (every import, function-level ones included):

    core  <-  integration (host seam, then the OpenRLHF glue)  <-  cpu (the CPU runtime)  <-  cli
    core, cpu  <-  evaluation (checkpoint evaluation)  <-  cli
    rewards  <-  data;  tasks  <-  testbed (toy model, pipeline, smoke runner: drives the cpu runtime)  <-  cli

Nothing imports upward, the worker side does not import the driver's experience maker, no two subpackages
import each other, and no module imports itself through others (an import cycle).
"""

import ast
import graphlib
import itertools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "d3s_openrlhf"

# subpackage -> the subpackages of ours it may import (besides itself)
ALLOWED = {
    "core": set(),
    "integration": {"core"},
    "cpu": {"core", "integration"},
    "tasks": set(),
    "rewards": set(),
    "data": {"rewards"},
    "testbed": {"tasks", "cpu", "integration", "core"},  # the sync check drives the LoRA sync; pass@k from core
    "evaluation": {"core", "cpu"},
    "cli": {"core", "integration", "cpu", "tasks", "testbed", "evaluation", "rewards"},
}


def imports_of(path):
    """The ``d3s_openrlhf.*`` modules a source file imports (a package import counts as its ``__init__``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("d3s_openrlhf")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("d3s_openrlhf"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return found


def subpackage(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


SOURCES = sorted(PACKAGE.rglob("*.py"))
GRAPH = {
    path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", "."): imports_of(path) for path in SOURCES
}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_no_upward_import(layer):
    upward = {
        (module, imported)
        for module, imported_modules in GRAPH.items()
        if subpackage(module) == layer
        for imported in imported_modules
        if subpackage(imported) not in (None, layer, *ALLOWED[layer])
    }
    assert not upward, upward


def test_every_subpackage_has_a_layer():
    assert {path.parent.name for path in PACKAGE.glob("*/__init__.py")} == set(ALLOWED)


def test_no_two_subpackages_import_each_other():
    edges = {
        (subpackage(module), subpackage(imported))
        for module, imported_modules in GRAPH.items()
        for imported in imported_modules
        if subpackage(module) and subpackage(imported) and subpackage(module) != subpackage(imported)
    }
    assert not {(a, b) for a, b in itertools.permutations(ALLOWED, 2) if (a, b) in edges and (b, a) in edges}


def test_the_worker_side_does_not_import_the_driver():
    for worker in ("actor", "loss", "replay_buffer", "training_forward", "experience_forward"):
        assert "d3s_openrlhf.integration.experience_maker" not in GRAPH[f"d3s_openrlhf.integration.{worker}"]


def module_of(name):
    """The source module a dotted name imports: the module itself, or the package's ``__init__``; None for a name
    defined inside a module."""
    for module in (name, f"{name}.__init__"):
        if module in GRAPH:
            return module
    return None


def modules_imported(path):
    """The modules of ours a source file imports: ``from package import module`` imports ``module``, ``from module
    import name`` imports ``module`` (the parent packages' ``__init__`` that any import runs first are not counted)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {module_of(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("d3s_openrlhf"):
            found |= {module_of(f"{node.module}.{alias.name}") or module_of(node.module) for alias in node.names}
    return found - {None}


def test_no_import_cycle():
    try:
        graphlib.TopologicalSorter({module: modules_imported(path) for module, path in zip(GRAPH, SOURCES)}).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"import cycle: {' -> '.join(error.args[1])}")
