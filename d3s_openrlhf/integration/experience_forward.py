"""The experience-making forwards without full-vocabulary logits.

At a step with token selection (K < 1) the actor's experience-making forward returns the old log-probs and the
policy entropy of the action positions, and the reference model's forward its log-probs. Upstream's
``Actor.forward`` builds the fp32 logits of every position for that, (B, S, V): at micro-batch 16 x 4096 tokens and
Qwen2.5's 151,936-token vocabulary about 40 GB, plus the head's bf16 output. ``head_free_log_probs`` runs upstream's
forward up to the LM head (``kept_forward.final_hidden_states``) and hands the final hidden states of the positions
that predict action tokens to ``core.logprobs.chunked_logprobs_entropy``, which holds one chunk of logits at a time
(about 256 MiB of them and their temporaries by default). The prompt's positions never reach the head.

The arithmetic is upstream's: the head's matmul in the parameters' dtype, the cast to fp32, the division by
``--rollout.temperature``, log-softmax and entropy in fp32; the results equal upstream's forward within float
rounding (the matmul runs on fewer rows at a time). Actor and reference take the same path at the same step, so at
equal weights their log-probs, and the KL between them, are exactly equal as upstream's are.

Under ZeRO-3 the head's partitioned parameters are gathered once per forward, in addition to upstream's gathering
for the (empty) head call: one more collective per forward, and every rank makes the same number of forwards.

Where it applies (``head_free_blocker`` returns the reason where it does not, the model actors add
``host.deepcompile_blocker``): the experience maker asks for it (token selection at this step), no
``--ds.deepcompile``, ``--d3s.full_logits`` is unset, no ring attention, a text model whose logits are the
head's output (``kept_forward.SUPPORTED_MODEL_TYPES``) and whose head is a plain ``nn.Linear`` (a LoRA-wrapped head
takes upstream's forward).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from openrlhf.models import Actor

from d3s_openrlhf.core.logprobs import chunked_logprobs_entropy
from d3s_openrlhf.integration.kept_forward import action_hidden, causal_lm, final_hidden_states, model_blocker


def head_free_blocker(actor: Actor, full_logits: bool, ring_attn_group=None) -> Optional[str]:
    """Why the experience-making forward of ``actor`` must build upstream's full logits, or None when it need not."""
    if full_logits:
        return "--d3s.full_logits is set"
    if ring_attn_group is not None:
        return "--ds.ring_attn_size > 1"
    reason = model_blocker(actor)
    if reason is not None:
        return reason
    head = causal_lm(actor).get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"an LM head of type {type(head).__name__} (not a plain nn.Linear)"
    return None


def _gathered(module: torch.nn.Module):
    """The module's parameters whole within the block: gathered under ZeRO-3, as they are otherwise."""
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params)
    return contextlib.nullcontext()


@torch.no_grad()
def head_free_log_probs(
    actor: Actor,
    sequences: torch.LongTensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    packed_seq_lens=None,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(action_log_probs, entropy)`` of upstream's ``Actor.forward(sequences, action_mask, attention_mask)``
    without its full logits (see the module docstring).

    Args:
        sequences, attention_mask: (B, S) as upstream's (padded; packed into (1, T) inside when the actor packs).
        action_mask: (B, A) response-token mask.
        chunk_size: positions per chunk of logits; None: ``core.logprobs.default_chunk_size``.

    Returns:
        Both (B, A) fp32 and 0 where ``action_mask`` is 0: the log-prob of each action token and the entropy of the
        temperature-scaled policy at the position that predicts it.
    """
    hidden, _ = final_hidden_states(actor, sequences, attention_mask, packed_seq_lens)
    rows, columns = action_mask.bool().nonzero(as_tuple=True)
    action_states, targets = action_hidden(actor, hidden, sequences, attention_mask, rows, columns, action_mask.shape[1])
    head = causal_lm(actor).get_output_embeddings()
    with _gathered(head):
        log_probs, entropy = chunked_logprobs_entropy(
            action_states, head.weight, targets, bias=head.bias, temperature=actor.temperature, chunk_size=chunk_size
        )
    grid = torch.zeros(action_mask.shape, dtype=torch.float32, device=hidden.device)
    return grid.index_put((rows, columns), log_probs), grid.index_put((rows, columns), entropy)


class HeadFreeForward:
    """Stands in for an ``Actor`` during one experience-making forward of a Ray model actor: called as upstream's
    model actors call it, it returns the action log-probs from :func:`head_free_log_probs` and keeps the entropy."""

    def __init__(self, model: Actor) -> None:
        self.model = model
        self.entropy: Optional[torch.Tensor] = None

    def __getattr__(self, name):  # eval(), train(), is_vlm, ... of the wrapped actor
        return getattr(self.model, name)

    def __call__(self, sequences, action_mask, attention_mask, ring_attn_group=None, packed_seq_lens=None, **mm_inputs):
        if ring_attn_group is not None or mm_inputs:
            raise ValueError("the head-free forward supports neither ring attention nor multimodal inputs")
        log_probs, self.entropy = head_free_log_probs(
            self.model, sequences, action_mask, attention_mask, packed_seq_lens=packed_seq_lens
        )
        return log_probs
