"""OpenRLHF glue for D3S/PODS: the host seam, experience maker, trainers, samples generator, worker-side actor.

Importing this package checks that the OpenRLHF it will hook is a 0.11.x release: the hook points used here
(``RemoteExperienceMaker.make_experience``, ``BasePPOTrainer.train_step``, ``SamplesGenerator._generate_vllm``, the
inline CLI parser of ``openrlhf.cli.train_ppo_ray``) are those of 0.11.x and change between minor releases. The
version is the installed distribution's; for a source checkout on ``PYTHONPATH`` (the patch path, no
``pip install``), the checkout's ``version.txt`` or ``pyproject.toml`` beside the ``openrlhf`` package it imports.
"""

import importlib.util
import re
from importlib import metadata
from pathlib import Path

SUPPORTED_OPENRLHF = "0.11"


def _checkout_version():
    """The version of the source checkout ``import openrlhf`` finds, or None: its ``version.txt``, else the
    ``version = "..."`` of its ``pyproject.toml``."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).resolve().parent.parent
    if (root / "version.txt").is_file():
        return (root / "version.txt").read_text().strip() or None
    if (root / "pyproject.toml").is_file():
        found = re.search(r'^version\s*=\s*"([^"]+)"', (root / "pyproject.toml").read_text(), re.MULTILINE)
        return found.group(1) if found else None
    return None


def _check_openrlhf_version() -> str:
    try:
        installed = metadata.version("openrlhf")
    except metadata.PackageNotFoundError:
        installed = _checkout_version()
    if installed is None:
        if importlib.util.find_spec("openrlhf") is None:
            raise ImportError(
                "d3s_openrlhf.integration needs OpenRLHF 0.11.x, but openrlhf is not installed "
                "(pip install --no-deps 'openrlhf>=0.11,<0.12')"
            )
        raise ImportError(
            "d3s_openrlhf.integration needs OpenRLHF 0.11.x, but the openrlhf it imports "
            f"({importlib.util.find_spec('openrlhf').origin}) has no installed metadata and no version.txt or "
            "pyproject.toml beside it; pip install -e your checkout, or run from a checkout that has its version.txt"
        )
    parts = installed.split(".")
    if ".".join(parts[:2]) != SUPPORTED_OPENRLHF:
        raise ImportError(
            f"d3s_openrlhf.integration supports OpenRLHF {SUPPORTED_OPENRLHF}.x only; "
            f"the installed openrlhf is {installed}"
        )
    return installed


OPENRLHF_VERSION = _check_openrlhf_version()
