"""The vLLM CPU engine follows the trainer's weights after OpenRLHF's own broadcast (gloo weight sync), and the
trainer's unmerged forward after the package's merged LoRA sync.

``python -m d3s_openrlhf.testbed.sync_check`` changes the toy model (tied embeddings: the LM head is the case
vLLM's CPU repacking would leave stale), syncs it twice through ``ActorPPOTrainer.broadcast_to_vllm`` and
reports the engine's prompt log-probs against the trainer's forward.
"""

import json
import subprocess
import sys

import pytest

from d3s_openrlhf.testbed import toy

pytestmark = pytest.mark.e2e


def sync_check(model_dir, *flags):
    done = subprocess.run(
        [sys.executable, "-m", "d3s_openrlhf.testbed.sync_check", model_dir, *flags],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("SYNC_CHECK "))
    return json.loads(line[len("SYNC_CHECK ") :])


def test_engine_logprobs_follow_synced_weights(tmp_path):
    model_dir = toy.save_model_and_tokenizer(str(tmp_path / "model"), seed=3)
    report = sync_check(model_dir, "--syncs", "2", "--scale", "2.0")
    assert report["tied_embeddings"] and report["lora_rank"] == 0
    assert report["initial_max_abs_diff"] < 0.1, report  # engine and model agree before any change (bf16)
    for sync in report["syncs"]:
        assert sync["stale_max_abs_diff"] > 0.3, report  # the change is large enough to be seen ...
        # ... and the engine serves the new weights (a stale LM head alone leaves ~20% of the change)
        assert sync["synced_max_abs_diff"] < min(0.1, sync["stale_max_abs_diff"] / 20), report


def test_the_engine_follows_the_trainers_unmerged_forward_through_a_lora_sync(tmp_path):
    # an update of std 1e-3, above bf16's rounding noise: the engine's log-probs move as the trainer's own forward
    # (the adapter kept apart from W) does, the first sync and the next, with no scale error. Smaller updates move
    # both by rounding noise alone, which no sync can make equal (benchmarks/RESULTS.md, section 8)
    model_dir = toy.save_model_and_tokenizer(str(tmp_path / "model"), seed=3)
    report = sync_check(model_dir, "--syncs", "2", "--lora-rank", "8", "--update-std", "1e-3")
    assert report["initial_max_abs_diff"] < 0.1, report
    for sync in report["syncs"]:
        assert sync["trainer_change_norm"] > 0.05, report  # the update moves the trainer's log-probs ...
        assert 0.9 <= sync["effect_share"] <= 1.1, report  # ... and the engine's by as much
