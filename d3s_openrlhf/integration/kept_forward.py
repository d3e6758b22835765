"""The actor's training forward with the LM head applied at the kept tokens only.

With token selection (K < 1) the PPO-clip surrogate needs the current policy's log-probs at the kept tokens alone:
a dropped token has advantage 0, so its term and gradient are 0 whatever its log-prob. Upstream's ``Actor.forward``
still applies the LM head and the fp32 log-softmax at every position: (B, S, V) logits, the largest activation of
the step (16 x 4096 x 151,936 fp32 is about 40 GB). ``kept_token_forward`` runs upstream's forward with the LM
head's input cut to zero positions (a forward pre-hook records the final hidden states instead), then applies the
LM head module itself to the hidden states of the kept tokens only, in one call under activation checkpointing:
the logits of the step shrink from (B, S, V) to (kept tokens, V), about K times upstream's, and are not kept
between the forward and the backward (except for a frozen head under ZeRO-3, see ``_recomputable``). Calling the
head module (not its weight) keeps ZeRO-3's parameter gathering, LoRA and tied embeddings as they are.

Where it applies (``kept_forward_blocker`` returns the reason where it does not): a pg mask in the micro-batch,
``--actor.policy_loss_type ppo`` (GSPO's sequence ratio needs every token), no KL loss (``--algo.kl.use_loss``),
no entropy loss (``--actor.entropy_coef``), no ``--ds.deepcompile`` (``host.deepcompile_blocker``), no ring
attention, a text model whose logits are the LM head's output (``SUPPORTED_MODEL_TYPES``: no logit soft-capping or
scaling after the head), and ``--d3s.full_logits`` unset.

What the trainer sees: ``(action_log_probs, output)`` as from upstream's forward. ``action_log_probs`` (B, A) is the
current policy's log-prob at the kept tokens and the given detached old log-prob elsewhere, so the ratio of a
dropped token is exactly 1: the surrogate and its gradient are unchanged, and the logged ``ppo_kl`` and
``ppo_clip_ratio`` count dropped tokens as unchanged (KL 0, not clipped). ``output.logits`` is empty (B, 0, V).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
from openrlhf.models import Actor
from openrlhf.models.ring_attn_utils import unpad_and_slice_tensor
from torch.utils.checkpoint import checkpoint

from d3s_openrlhf.integration.host import deepcompile_blocker, loss_needs_every_token

# Causal LMs whose forward returns lm_head(final hidden states) as the logits, with nothing applied after the head.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
        "phi3",
        "olmo2",
    }
)

def causal_lm(actor: Actor) -> torch.nn.Module:
    """The Hugging Face model inside the actor (under a DeepSpeed engine and/or a PEFT wrapper)."""
    return getattr(actor.model, "module", actor.model)


def model_blocker(actor: Actor) -> Optional[str]:
    """Why the actor's logits may not be its LM head's output on the final hidden states alone, or None."""
    if getattr(actor, "is_vlm", False):
        return "a vision-language model"
    model = causal_lm(actor)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or model.get_output_embeddings() is None:
        return f"model type {model_type!r} (its logits may not be the LM head's output alone)"
    return None


def kept_forward_blocker(args, actor: Actor, full_logits: bool, ring_attn_group=None) -> Optional[str]:
    """Why the kept-token forward cannot replace upstream's training forward here, or None when it can."""
    if full_logits:
        return "--d3s.full_logits is set"
    reason = loss_needs_every_token(args) or deepcompile_blocker(args)
    if reason is not None:
        return reason
    if ring_attn_group is not None:
        return "--ds.ring_attn_size > 1"
    return model_blocker(actor)


@contextlib.contextmanager
def head_input_recorded(head: torch.nn.Module, store: list) -> Iterator[None]:
    """Within the block the head's first call records its input (..., T, H) in ``store`` and runs on zero
    positions instead, so the model computes no logits."""

    def pre_hook(module, args):
        if store:
            return None
        hidden = args[0]
        store.append(hidden)
        return (hidden[..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()


def final_hidden_states(actor: Actor, sequences, attention_mask, packed_seq_lens=None):
    """Upstream's ``Actor.forward(..., return_output=True)`` with the LM head run on zero positions (ZeRO-3 still
    gathers and releases its weight as in a full forward). Returns ``(hidden, output)``: the head's input, (B, S, H)
    padded or (1, T, H) packed, and upstream's output with empty logits."""
    head = causal_lm(actor).get_output_embeddings()
    recorded = []
    with head_input_recorded(head, recorded):
        output = Actor.forward(
            actor, sequences, None, attention_mask, return_output=True, packed_seq_lens=packed_seq_lens
        )
    (hidden,) = recorded
    return hidden, output


def action_hidden(actor: Actor, hidden, sequences, attention_mask, rows, columns, width: int):
    """Final hidden states that predict the action tokens (rows, columns) of a (B, A) action grid, and those tokens.

    hidden: from :func:`final_hidden_states`; rows, columns: (k,) indices into (B, A) -> ((k, H), (k,))."""
    seqlen = sequences.shape[1]
    # action position a is predicted at sequence position S - 1 - A + a (upstream: log_probs[:, :-1][:, -A:])
    positions = seqlen - 1 - width + columns
    targets = sequences[rows, positions + 1]
    if not actor.packing_samples:
        return hidden[rows, positions], targets
    indices = unpad_and_slice_tensor(sequences, attention_mask, None)[-1]
    packed_index = torch.full((sequences.numel(),), -1, dtype=torch.long, device=hidden.device)
    packed_index[indices] = torch.arange(indices.numel(), device=hidden.device)
    return hidden[0, packed_index[rows * seqlen + positions]], targets


def _kept_log_probs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log softmax(head(hidden) / temperature)[targets] in fp32, as upstream's ``log_probs_from_logits``.

    hidden (k, H), targets (k,) -> (k,)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _recomputable(head: torch.nn.Module) -> bool:
    """Whether the head call can be recomputed in the backward. Not with a frozen weight under ZeRO-3 (LoRA's base
    weight, adapted or not): it is released after the recompute's forward hook and nothing gathers it again for
    its backward (``CheckpointError``: a recomputed weight of shape [0]); the kept-token logits are then kept for
    the backward as a plain module call's are, at most K times upstream's full logits."""
    return not any(hasattr(p, "ds_id") and not p.requires_grad for p in head.parameters())


def kept_token_forward(
    actor: Actor,
    sequences: torch.LongTensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    pg_mask: torch.Tensor,
    fill_log_probs: torch.Tensor,
    return_output: bool = False,
    ring_attn_group=None,
    packed_seq_lens=None,
    return_entropy: bool = False,
):
    """Upstream's ``Actor.forward(sequences, action_mask, attention_mask, return_output=...)`` for a training step
    whose loss reads the log-probs of the ``pg_mask`` tokens only (see the module docstring).

    Args:
        sequences, attention_mask: (B, S) as upstream's.
        action_mask: (B, A) response-token mask.
        pg_mask: (B, A) bool, the kept tokens (ANDed with ``action_mask``).
        fill_log_probs: (B, A) log-probs returned (detached) at the other positions, normally the old ones.
    """
    if return_entropy:
        raise ValueError("the kept-token forward computes no entropy; use upstream's forward with an entropy loss")
    if ring_attn_group is not None:
        raise ValueError("the kept-token forward does not support ring attention")
    head = causal_lm(actor).get_output_embeddings()
    hidden, output = final_hidden_states(actor, sequences, attention_mask, packed_seq_lens)
    rows, columns = (pg_mask.bool() & action_mask.bool()).nonzero(as_tuple=True)
    kept_hidden, targets = action_hidden(actor, hidden, sequences, attention_mask, rows, columns, action_mask.shape[1])

    # One head call for all kept tokens, also when there are none: under ZeRO-3 every head call gathers its
    # weight with a collective, so every rank must make the same number of calls (chunking by the local count of
    # kept tokens would hang). Checkpointing drops these logits between the forward and the backward.
    kept_log_probs = functools.partial(_kept_log_probs, head, temperature=actor.temperature)
    if _recomputable(head):
        kept_log_probs = functools.partial(checkpoint, kept_log_probs, use_reentrant=False)
    kept_log_probs = kept_log_probs(kept_hidden, targets)
    fill = (fill_log_probs.detach().float() * action_mask).to(kept_log_probs.dtype)
    action_log_probs = fill.index_put((rows, columns), kept_log_probs)
    return (action_log_probs, output) if return_output else action_log_probs
