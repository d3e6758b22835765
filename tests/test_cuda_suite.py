"""The CUDA tests run where a GPU user has them: a machine with CUDA, torch, transformers, deepspeed, flash-attn and
openrlhf, but without Ray or vLLM (OpenRLHF's GPU training image needs neither to train one actor). Their command,
``pytest -m cuda tests/core tests/cuda``, must collect there."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Ray and vLLM made unimportable (a None entry in sys.modules raises ImportError), then pytest's collection
COLLECT = """
import sys
for name in ("ray", "vllm"):
    sys.modules[name] = None
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "cuda", "tests/core", "tests/cuda"]))
"""


def test_the_cuda_tests_collect_without_ray_or_vllm():
    done = subprocess.run([sys.executable, "-c", COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert any(line.startswith("tests/cuda/") for line in collected), done.stdout[-2000:]
    assert any(line.startswith("tests/core/") for line in collected), done.stdout[-2000:]
    params = [line.partition("[")[2] for line in collected]
    assert all("cuda" in p or "cpu" not in p for p in params)  # the marker selects the CUDA cases only
