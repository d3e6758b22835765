"""The vLLM CPU engine follows the trainer's weights after OpenRLHF's own broadcast (gloo weight sync), and the
merged LoRA weights after the package's LoRA sync.

``python -m d3s_openrlhf.testbed.sync_check`` perturbs the toy model (tied embeddings: the LM head is the case
vLLM's CPU repacking would leave stale), syncs it twice through ``ActorPPOTrainer.broadcast_to_vllm`` and
reports the engine's prompt log-probs against the perturbed model's.
"""

import json
import subprocess
import sys

import pytest

from d3s_openrlhf.testbed import toy

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_engine_logprobs_follow_synced_weights(lora_rank, tmp_path):
    model_dir = toy.save_model_and_tokenizer(str(tmp_path / "model"), seed=3)
    command = [sys.executable, "-m", "d3s_openrlhf.testbed.sync_check", model_dir, "--syncs", "2", "--scale", "2.0"]
    done = subprocess.run(
        [*command, "--lora-rank", str(lora_rank)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("SYNC_CHECK "))
    report = json.loads(line[len("SYNC_CHECK ") :])
    assert report["tied_embeddings"] and report["lora_rank"] == lora_rank
    assert report["initial_max_abs_diff"] < 0.1, report  # engine and model agree before any change (bf16)
    for sync in report["syncs"]:
        assert sync["stale_max_abs_diff"] > 0.3, report  # the change is large enough to be seen ...
        # ... and the engine serves the new weights (a stale LM head alone leaves ~20% of the change)
        assert sync["synced_max_abs_diff"] < min(0.1, sync["stale_max_abs_diff"] / 20), report
