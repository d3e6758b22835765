import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    BLOCKED = ("openrlhf", "ray", "deepspeed", "vllm")
    attempts = []

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                attempts.append(name)
                raise ImportError(f"blocked for this test: {name}")
            return None

    sys.meta_path.insert(0, Block())
    try:
        import ray  # the block itself must work
    except ImportError:
        pass
    else:
        raise SystemExit("the import block did not take effect")
    attempts.clear()

    import d3s_openrlhf
    import d3s_openrlhf.core as core

    names = sorted(m.name for m in pkgutil.iter_modules(core.__path__))
    for name in names:
        importlib.import_module(f"d3s_openrlhf.core.{name}")
    assert {"advantages", "batching", "config", "entropy", "schedule", "token_mask"} <= set(names), names
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    assert not attempts, attempts
    print("imported", ",".join(names))
    """
)


def test_core_imports_with_heavy_packages_blocked():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported" in result.stdout
