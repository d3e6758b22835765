"""Shared fixtures. ``toy_sft``: the SFT warm start of the toy model, once per session (every real Ray run of the
suite, end-to-end and launch-script smoke, starts from it). ``peak_memory``: peak CPU memory allocated while a
function runs, from torch's own allocator events (``benchmarks/memory_probe.py``, the benchmarks' probe).
``device`` and ``generator_device``: every device a test runs on (CUDA marked ``cuda``, skipped where there is none).

Time limits (pytest-timeout): setup.cfg's ``timeout`` for every test; :data:`E2E_TIMEOUT_S` for the end-to-end
tests, unless a test sets its own ``@pytest.mark.timeout``. A hang then fails one test, not the whole run.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from memory_probe import peak_allocated_bytes  # noqa: E402

# the first end-to-end test also pays for the session's SFT warm start (about a minute on 2 cores beside the other
# half of the suite); a test of two runs of ~1-3 min each fits twice over
E2E_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


@pytest.fixture(scope="session")
def toy_sft(tmp_path_factory):
    """``pipeline.Prepared`` of the built-in addition task: the demo's SFT (~40% of sampled answers right), so that
    nearly every group has reward variance and every optimizer window sees non-zero advantages (OpenRLHF logs
    the grad norm of a step's last window only)."""
    from d3s_openrlhf.testbed import pipeline

    # one OpenMP thread: the SFT trains in the launcher's own process, beside the other half of the suite (nice 19,
    # tests/run.sh), where torch's two threads spin on two busy cores: 226 s against 73 s (54 s alone with two)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        return pipeline.prepare(str(tmp_path_factory.mktemp("toy")))


@pytest.fixture
def peak_memory():
    """``peak_memory(fn, *args, **kwargs)`` -> ``(result, peak bytes allocated during the call)``."""
    return peak_allocated_bytes


# the CUDA cases carry the ``cuda`` marker: ``pytest -m cuda tests/core tests/cuda`` runs them all on a GPU machine
NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device the tensors of a test live on."""
    return request.param


@pytest.fixture(params=DEVICES)
def generator_device(request):
    """Each device a test's ``torch.Generator`` draws on (independent of ``device``)."""
    return request.param
