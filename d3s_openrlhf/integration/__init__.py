"""OpenRLHF glue for D3S/PODS: experience maker, trainers, worker-side actor.

Importing this package checks that the installed OpenRLHF is a 0.11.x release: the hook points used here
(``RemoteExperienceMaker.make_experience``, ``BasePPOTrainer.train_step``, the inline CLI parser of
``openrlhf.cli.train_ppo_ray``) are those of 0.11.x and change between minor releases.
"""

from importlib import metadata

SUPPORTED_OPENRLHF = "0.11"


def _check_openrlhf_version() -> str:
    try:
        installed = metadata.version("openrlhf")
    except metadata.PackageNotFoundError as exc:
        raise ImportError(
            "d3s_openrlhf.integration needs OpenRLHF 0.11.x, but openrlhf is not installed "
            "(pip install --no-deps 'openrlhf>=0.11,<0.12')"
        ) from exc
    parts = installed.split(".")
    if ".".join(parts[:2]) != SUPPORTED_OPENRLHF:
        raise ImportError(
            f"d3s_openrlhf.integration supports OpenRLHF {SUPPORTED_OPENRLHF}.x only; "
            f"the installed openrlhf is {installed}"
        )
    return installed


OPENRLHF_VERSION = _check_openrlhf_version()
