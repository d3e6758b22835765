"""integration/experience_forward.py: the experience-making forwards with chunked logits against upstream's
``Actor.forward`` (a tiny Llama, no hub). Through the Ray model actors' ``forward`` in test_integration_actor.py."""

import pytest
import torch
from actor_batches import (
    load_actor,
    make_experience,
    record_head_inputs,
    upstream_action_entropy,
    wide_vocabulary_batch,
)

from d3s_openrlhf.integration.experience_forward import chunked_logits_log_probs


@pytest.mark.parametrize("left_pad", [False, True], ids=["whole_prompts", "left_padded_prompts"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_logits_log_probs_equal_upstreams_forward(model_dir, cpu_cuda, packing, temperature, dtype, left_pad):
    actor = load_actor(model_dir, temperature=temperature, packing_samples=packing)
    actor.model.to(dtype)
    e = make_experience(actor, seed=41, rows=5, pg=None, left_pad=left_pad)
    assert bool((e.attention_mask[:, 0] == 0).any()) == left_pad
    e.action_mask[3] = False  # a rollout without action tokens (an empty response)
    with torch.no_grad():
        expected = actor(e.sequences, e.action_mask, e.attention_mask)
    heads = record_head_inputs(actor)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for chunk_size, with_entropy in ((None, True), (1, True), (3, True), (None, False), (3, False)):
        heads.clear()
        log_probs, entropy = chunked_logits_log_probs(
            actor, e.sequences, e.action_mask, e.attention_mask, chunk_size=chunk_size, with_entropy=with_entropy
        )
        assert heads == [(int(e.action_mask.sum()), 64)]  # once, on the action positions only
        assert log_probs.dtype == torch.float32 and log_probs.shape == e.action_mask.shape
        torch.testing.assert_close(log_probs, expected, **tolerance)
        assert torch.all(log_probs[~e.action_mask] == 0)
        if not with_entropy:
            assert entropy is None
            continue
        assert entropy.dtype == torch.float32
        torch.testing.assert_close(entropy, upstream_action_entropy(actor, e), **tolerance)
        assert torch.all(entropy[~e.action_mask] == 0)


def test_chunked_logits_forward_never_holds_the_full_logits(tmp_path, cpu_cuda, peak_memory):
    actor, sequences, attention_mask, action_mask = wide_vocabulary_batch(tmp_path, rows=4)
    (rows, length), vocab = sequences.shape, actor.model.config.vocab_size
    full_logits_bytes = rows * length * vocab * 4
    with torch.no_grad():
        expected, upstream_peak = peak_memory(actor, sequences, action_mask, attention_mask)
    (log_probs, _), peak = peak_memory(
        chunked_logits_log_probs, actor, sequences, action_mask, attention_mask, chunk_size=8
    )
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
    assert upstream_peak >= full_logits_bytes  # the measurement sees upstream's logits
    chunk_bytes = 8 * vocab * 4
    assert peak < 6 * chunk_bytes < full_logits_bytes / 4, (peak, chunk_bytes, full_logits_bytes)
