"""The experience-making forwards of the Ray model actors: with chunked logits (never the full-vocabulary logits),
and the entropy tap.

At a step with token selection (K < 1), or at every step with ``--d3s.chunked_logits``, the actor's
experience-making forward returns the old log-probs (and, for token selection, the policy entropy) of the action
positions, and the reference model's forward its log-probs. The entropy is computed only where the token scores
read it (the actor at a step with token selection); the other forwards do the log-prob work alone. Upstream's
``Actor.forward`` builds the fp32 logits of every position for that, (B, S, V): at micro-batch 16 x 4096 tokens and
Qwen2.5's 151,936-token vocabulary about 40 GB, plus the head's bf16 output. ``chunked_logits_log_probs`` runs the
model up to its LM head and scores only the positions that predict action tokens, one block of logits at a time
(``training_forward``). The prompt's positions never reach the head.

The arithmetic is upstream's: the head's matmul in the parameters' dtype, the cast to fp32, the division by
``--rollout.temperature``, log-softmax and entropy in fp32; the results equal upstream's forward within float
rounding (the matmul runs on fewer rows at a time). Actor and reference take the same path at the same step and
cut the same tokens into the same blocks (their sizes follow the shapes alone), so at equal weights their log-probs
agree bit for bit and the KL between them is exactly 0.

Where it applies: the experience maker asks for it, and ``training_forward.training_forward_blocker`` finds nothing
against it (the same rule as the training forward's). Where it does not and the token scores need the entropy,
``EntropyTap`` takes it from upstream's full logits instead.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from openrlhf.models import Actor
from openrlhf.models.ring_attn_utils import gather_and_pad_tensor

from d3s_openrlhf.core.entropy import entropy_from_logits
from d3s_openrlhf.integration.training_forward import action_log_probs_entropy


@torch.no_grad()
def chunked_logits_log_probs(
    actor: Actor,
    sequences: torch.LongTensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    packed_seq_lens=None,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(action_log_probs, entropy)`` of upstream's ``Actor.forward(sequences, action_mask, attention_mask)``
    without its full logits (see the module docstring).

    Args:
        sequences, attention_mask: (B, S) as upstream's (padded; packed into (1, T) inside when the actor packs).
        action_mask: (B, A) response-token mask.
        chunk_size: positions per chunk of logits; None: ``core.logprobs.chunked_logprobs_entropy``'s default.
        with_entropy: compute the entropy too (token selection's scores); None is returned in its place without.

    Returns:
        Both (B, A) fp32 and 0 where ``action_mask`` is 0: the log-prob of each action token and the entropy of the
        temperature-scaled policy at the position that predicts it. A non-finite one raises FloatingPointError
        naming its source (``training_forward.NonFiniteCheck``).
    """
    # a non-finite result is refused before returning: the caller copies the results to the host next anyway
    log_probs, entropy, index, _ = action_log_probs_entropy(
        actor, sequences, action_mask, attention_mask, action_mask, packed_seq_lens, chunk_size, with_entropy
    )
    grid = torch.zeros(action_mask.shape, dtype=torch.float32, device=log_probs.device)
    return grid.index_put(index, log_probs), None if entropy is None else grid.index_put(index, entropy)


class ChunkedLogitsForward:
    """Stands in for an ``Actor`` during one experience-making forward of a Ray model actor: called as upstream's
    model actors call it, it returns the action log-probs from :func:`chunked_logits_log_probs` and, ``with_entropy``,
    keeps the entropy (else ``entropy`` stays None)."""

    def __init__(self, model: Actor, with_entropy: bool = False) -> None:
        self.model = model
        self.with_entropy = with_entropy
        self.entropy: Optional[torch.Tensor] = None

    def __getattr__(self, name):  # eval(), train(), is_vlm, ... of the wrapped actor
        return getattr(self.model, name)

    def __call__(self, sequences, action_mask, attention_mask, ring_attn_group=None, packed_seq_lens=None, **mm_inputs):
        if ring_attn_group is not None or mm_inputs:
            raise ValueError("the chunked-logits forward supports neither ring attention nor multimodal inputs")
        log_probs, self.entropy = chunked_logits_log_probs(
            self.model,
            sequences,
            action_mask,
            attention_mask,
            packed_seq_lens=packed_seq_lens,
            with_entropy=self.with_entropy,
        )
        return log_probs


class EntropyTap:
    """Stands in for the actor model during one experience-making forward: calls it with return_output=True,
    keeps the per-token entropy of the action positions and returns the log-probs as the plain call would."""

    def __init__(self, model) -> None:
        self.model = model
        self.entropy: Optional[torch.Tensor] = None

    def __getattr__(self, name):  # eval(), train(), is_vlm, ... of the wrapped actor
        return getattr(self.model, name)

    def __call__(self, sequences, action_mask, attention_mask, **kwargs):
        action_log_probs, output = self.model(sequences, action_mask, attention_mask, return_output=True, **kwargs)
        logits = output["logits"]  # fp32, temperature-scaled: the policy the log-probs describe
        width = action_mask.shape[1]
        if getattr(self.model, "packing_samples", False):
            # packed (1, local tokens, V): entropy of every local position, gathered and re-padded to (B, S) the
            # way OpenRLHF's Actor re-pads its own entropy and log-probs
            ring_group = kwargs.get("ring_attn_group")
            indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
            pad_len = 0
            if ring_group is not None:
                ring_size = dist.get_world_size(group=ring_group)
                pad_len = (ring_size - indices.numel() % ring_size) % ring_size
            entropy = gather_and_pad_tensor(entropy_from_logits(logits), ring_group, pad_len, indices, *sequences.shape)
            entropy = entropy[:, :-1][:, -width:]
        else:
            # position t predicts token t + 1 (as in Actor.forward): logits[:, :-1], then the last A positions
            entropy = entropy_from_logits(logits[:, :-1][:, -width:])
        self.entropy = entropy * action_mask.to(entropy.dtype)
        return action_log_probs
