"""Issue 30 item 5, reproduced and not yet fixed: the head-free experience forward gives NaN log-probs and entropy
under ZeRO-3 on 2 ranks, LoRA, a tied Qwen2 embedding large enough for ZeRO-3 to partition it (4096 x 64 > the
1e5-element persistence threshold; at a 512 vocabulary nothing is partitioned and nothing fails), packing,
gradient checkpointing, temperature 0.7. It depends on the random model, not on the data: of models 1000-1002,
1002 fails at every batch on both ranks (a few positions of each, log-prob and entropy alike), the others never
(2026-11-25, CPU). Not a strict xfail: the cause is unknown, so whether another machine reproduces it is too (an
XPASS is reported, not failed); once fixed, the marker goes.

Real: DeepSpeed ZeRO-3 on two gloo processes, OpenRLHF's ``Actor`` loaded from a checkpoint under ``zero.Init``,
PEFT, ``head_free_log_probs``; the CPU runtime's stand-ins (flash-attention, CUDA calls). Slow (about a minute).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # two DeepSpeed processes: run as the heavy tests are

SCRIPT = Path(__file__).with_name("zero3_head_free_check.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.xfail(strict=False, raises=AssertionError, reason="issue 30 item 5: cause not found yet")
def test_head_free_forward_is_finite_under_zero3_with_a_partitioned_tied_embedding():
    env = dict(os.environ, VOCAB="4096", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "8", "1", "1", "1002"], capture_output=True, text=True, env=env, timeout=900
    )
    if run.returncode != 0 or "model 1002" not in run.stdout:
        raise RuntimeError(f"the check did not run: exit {run.returncode}\n{run.stderr[-3000:]}")
    assert "clean" in run.stdout, run.stdout
