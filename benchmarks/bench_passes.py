"""Passes over each block of logits, forward and backward, for our kernel and for upstream's ``Actor.forward``.

Counted by ``pass_count.block_passes`` (every ATen operator that reads or writes a tensor of at least one block:
N positions x V vocabulary; ATen's logsumexp as its four kernels) on a tiny model, with a temperature != 1 and the
head in fp32 (a CPU's dtype) or bf16 (a GPU's: one more pass for the fp32 cast, and its gradient's cast back):
* ``ours``: ``core.logprobs.chunked_logprobs_entropy`` with one chunk and one vocabulary block (so its per-block
  counts are its totals), the log-probs alone or with the entropy, and the gradient of a loss of what it returned;
* ``upstream torch``: OpenRLHF's ``Actor.forward`` on a Qwen2-like model (its head over every position, the fp32
  cast, the division by the temperature, ``log_probs_from_logits``'s torch path; ``return_entropy`` adds
  ``compute_entropy``, counted in its eager form: upstream compiles it with ``torch.compile``, which fuses some of
  its kernels), and the gradient of a loss of its log-probs (and entropy).

Upstream's Triton path (flash-attn's ``cross_entropy_loss``, which needs CUDA and Triton) is not run here: it is the
torch path with ``log_probs_from_logits``'s passes replaced by the Triton kernels', one pass forward (an online
logsumexp that reads each row once) and one backward (reads the logits, writes their gradient), read from
``flash_attn/ops/triton/cross_entropy.py``; the table prints that count beside the torch path's.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_passes.py      # prints the table of docs/semantics.md
"""

from __future__ import annotations

import torch
from openrlhf.models import Actor
from openrlhf.models.utils import compute_entropy
from transformers import Qwen2Config, Qwen2ForCausalLM

from d3s_openrlhf.core.logprobs import chunked_logprobs_entropy
from pass_count import block_passes  # benchmarks/ is sys.path[0] when this file runs

TOKENS, VOCAB, HIDDEN, TEMPERATURE = 33, 4096, 8, 0.7
BLOCK = (TOKENS - 1) * VOCAB  # the logits of the scored positions; weights (V x H) and the body stay below it
# log_probs_from_logits's torch path: gather (not a pass) and logsumexp's 4 kernels forward; its backward, the
# logsumexp gradient (subtract, exp, multiply), the gradient of its 1024-row slices (zero-filled), the gather's
# zero-filled gradient and the sum of the two
TORCH_LOG_PROBS = {"forward": 4, "backward": 6}
TRITON_LOG_PROBS = {"forward": 1, "backward": 1}


def _described(counter) -> str:
    return f"{sum(counter.values())} ({', '.join(f'{name} {n}' if n > 1 else name for name, n in counter.items())})"


def ours(dtype, with_entropy):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS - 1, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS - 1,), generator=generator)
    (log_probs, entropy), forward = block_passes(
        lambda: chunked_logprobs_entropy(
            hidden,
            weight,
            targets,
            temperature=TEMPERATURE,
            chunk_size=TOKENS - 1,
            vocab_block=VOCAB,
            with_entropy=with_entropy,
        ),
        BLOCK,
    )
    loss = log_probs.sum() + (entropy.sum() if with_entropy else 0)
    _, backward = block_passes(loss.backward, BLOCK)
    return forward, backward


def upstream(dtype, with_entropy):
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    actor = Actor(Qwen2ForCausalLM(config).to(dtype), temperature=TEMPERATURE)
    actor.packing_samples = False
    sequences = torch.randint(0, VOCAB, (1, TOKENS))
    attention_mask = torch.ones_like(sequences)
    action_mask = torch.ones(1, TOKENS - 1, dtype=torch.bool)
    eager_entropy = getattr(compute_entropy, "_torchdynamo_orig_callable", compute_entropy)
    import openrlhf.models.actor as actor_module

    saved, actor_module.compute_entropy = actor_module.compute_entropy, eager_entropy
    try:
        (log_probs, output), forward = block_passes(
            lambda: actor(sequences, action_mask, attention_mask, return_output=True, return_entropy=with_entropy),
            BLOCK,
        )
    finally:
        actor_module.compute_entropy = saved
    loss = log_probs.sum() + (output.entropy.sum() if with_entropy else 0)
    _, backward = block_passes(loss.backward, BLOCK)
    return forward, backward


def main() -> None:
    print("| head dtype | variant | outputs | forward passes | backward passes |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        for with_entropy in (False, True):
            outputs = "log-probs + entropy" if with_entropy else "log-probs"
            forward, backward = ours(dtype, with_entropy)
            print(f"| {tag} | ours | {outputs} | {_described(forward)} | {_described(backward)} |")
            forward, backward = upstream(dtype, with_entropy)
            print(f"| {tag} | upstream torch | {outputs} | {_described(forward)} | {_described(backward)} |")
            triton = [
                sum(counter.values()) - TORCH_LOG_PROBS[phase] + TRITON_LOG_PROBS[phase]
                for phase, counter in (("forward", forward), ("backward", backward))
            ]
            print(f"| {tag} | upstream triton | {outputs} | {triton[0]} | {triton[1]} |")


if __name__ == "__main__":
    main()
