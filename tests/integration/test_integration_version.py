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
    with pytest.raises(ImportError, match="openrlhf is not installed"):
        integration._check_openrlhf_version()
