"""The OpenRLHF version gate of ``d3s_openrlhf.integration``."""

from __future__ import annotations

from importlib import metadata

import pytest

import d3s_openrlhf.integration as integration


def test_installed_openrlhf_is_supported():
    assert integration.OPENRLHF_VERSION == metadata.version("openrlhf")
    assert integration.OPENRLHF_VERSION.startswith("0.11.")


@pytest.mark.parametrize("version", ["0.12.0", "0.10.9", "0.110.0", "1.0.0"])
def test_other_versions_are_refused_with_the_installed_version_named(monkeypatch, version):
    monkeypatch.setattr(integration.metadata, "version", lambda name: version)
    with pytest.raises(ImportError, match=f"supports OpenRLHF 0.11.x only; the installed openrlhf is {version}"):
        integration._check_openrlhf_version()


@pytest.mark.parametrize("version", ["0.11.0", "0.11.2", "0.11.10.post1"])
def test_any_0_11_release_is_accepted(monkeypatch, version):
    monkeypatch.setattr(integration.metadata, "version", lambda name: version)
    assert integration._check_openrlhf_version() == version


def test_missing_openrlhf_is_refused(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(integration.metadata, "version", not_installed)
    monkeypatch.setattr(integration.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="openrlhf is not installed"):
        integration._check_openrlhf_version()


PROBE = """
import sys
from importlib import metadata

real = metadata.version

def version(name):  # the checkout is on PYTHONPATH, not pip-installed: no metadata for it
    if name == "openrlhf":
        raise metadata.PackageNotFoundError(name)
    return real(name)

metadata.version = version
try:
    import d3s_openrlhf.integration as integration
except ImportError as error:
    print("refused:", error)
else:
    import openrlhf
    print("version:", integration.OPENRLHF_VERSION, openrlhf.__file__)
"""


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"version.txt": "0.11.2\n"}, "version: 0.11.2 {checkout}/openrlhf/__init__.py"),
        ({"pyproject.toml": '[project]\nname = "openrlhf"\nversion = "0.11.3"\n'}, "version: 0.11.3"),
        ({"version.txt": "0.12.0"}, "refused: d3s_openrlhf.integration supports OpenRLHF 0.11.x only"),
        ({}, "refused: d3s_openrlhf.integration needs OpenRLHF 0.11.x, but the openrlhf it imports"),
    ],
    ids=["version.txt", "pyproject", "unsupported", "no-version"],
)
def test_a_source_checkout_without_metadata(tmp_path, files, expected):
    import os
    import shutil
    import subprocess
    import sys

    import openrlhf

    checkout = tmp_path / "OpenRLHF"
    shutil.copytree(os.path.dirname(openrlhf.__file__), checkout / "openrlhf", ignore=shutil.ignore_patterns("*.pyc"))
    for name, text in files.items():
        (checkout / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert expected.format(checkout=checkout) in done.stdout, done.stdout + done.stderr[-3000:]
