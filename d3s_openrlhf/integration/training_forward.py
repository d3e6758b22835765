"""The actor's chunked-logits forwards: log-probs (and entropy) from the final hidden states, never the full logits.

Upstream's ``Actor.forward`` applies the LM head and the fp32 log-softmax at every position: (B, S, V) logits, the
largest activation of a step (16 x 4096 x 151,936 fp32 is about 40 GB). Here the model runs up to its LM head
(``final_hidden_states``: the head is swapped out of the model for that forward, so nothing computes logits), the
hidden states of the positions whose log-probs the loss reads are picked (``action_hidden``), and one call of the
head module computes their log-probs (and the entropy, only where the loss has an entropy term: upstream's
``return_entropy``, set by ``--actor.entropy_coef``) with ``core.logprobs.chunked_logprobs_entropy`` in place of
its own forward (``head_log_probs``), one block of logits at a time, with gradients through both.

Calling the head module (not reading its weight from outside) keeps ZeRO-3's gathering as upstream has it: the
head is gathered once per forward, by its own hooks, and once for its backward; its hooks see the usual module
order (body, then head). Every rank makes the one head call also when it has no position to score, so the
collectives match.

Which positions (``training_forward``'s ``log_prob_mask``): every action token where the loss reads them all (a KL
loss, GSPO's sequence ratio, an entropy bonus, or no token selection at this step), else only the kept tokens of
the pg mask: a dropped token has advantage 0, so its PPO-clip term and gradient are 0 whatever its log-prob.

Where it applies (``training_forward_blocker`` returns the reason where it does not): no ``--d3s.full_logits``, no
``--ds.deepcompile`` (``host.deepcompile_blocker``), no ring attention, a text model whose logits are the LM head's
output (``SUPPORTED_MODEL_TYPES``: no logit soft-capping or scaling after the head) and whose head is a plain
``nn.Linear`` (a LoRA-wrapped head takes upstream's forward).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from openrlhf.models import Actor
from openrlhf.models.ring_attn_utils import unpad_and_slice_tensor

from d3s_openrlhf.core.logprobs import chunked_logprobs_entropy
from d3s_openrlhf.integration.host import deepcompile_blocker

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


def head_blocker(actor: Actor) -> Optional[str]:
    """Why the actor's logits may not be its plain linear LM head's output on the final hidden states, or None."""
    if getattr(actor, "is_vlm", False):
        return "a vision-language model"
    model = causal_lm(actor)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    head = model.get_output_embeddings() if model_type in SUPPORTED_MODEL_TYPES else None
    if head is None:
        return f"model type {model_type!r} (its logits may not be the LM head's output alone)"
    if type(head) is not torch.nn.Linear:
        return f"an LM head of type {type(head).__name__} (not a plain nn.Linear)"
    return None


def training_forward_blocker(args, actor: Actor, full_logits: bool, ring_attn_group=None) -> Optional[str]:
    """Why the forwards here cannot replace upstream's for ``actor``, or None when they can."""
    if full_logits:
        return "--d3s.full_logits is set"
    reason = deepcompile_blocker(args)
    if reason is not None:
        return reason
    if ring_attn_group is not None:
        return "--ds.ring_attn_size > 1"
    return head_blocker(actor)


class _HiddenRecorder(torch.nn.Module):
    """Stands in for the LM head inside the model's forward: records its input, returns (..., 0, V) logits."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden: Optional[torch.Tensor] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.hidden is None:
            self.hidden = hidden
        return hidden.new_empty(*hidden.shape[:-2], 0, self.vocab_size)


@contextlib.contextmanager
def _head_swapped_out(model: torch.nn.Module, head: torch.nn.Module) -> Iterator[_HiddenRecorder]:
    """Within the block the model's submodule ``head`` is a :class:`_HiddenRecorder` (ZeRO-3 gathers nothing for
    it; the head's own hooks stay on the head)."""
    parent, name = next(
        (module, child_name)
        for module in model.modules()
        for child_name, child in module.named_children()
        if child is head
    )
    recorder = _HiddenRecorder(head.out_features)
    setattr(parent, name, recorder)
    try:
        yield recorder
    finally:
        setattr(parent, name, head)


def final_hidden_states(actor: Actor, sequences, attention_mask, packed_seq_lens=None):
    """Upstream's ``Actor.forward(..., return_output=True)`` without its LM head. Returns ``(hidden, output)``: the
    head's input, (B, S, H) padded or (1, T, H) packed, and upstream's output with empty logits (B, 0, V)."""
    model = causal_lm(actor)
    with _head_swapped_out(model, model.get_output_embeddings()) as recorder:
        output = Actor.forward(
            actor, sequences, None, attention_mask, return_output=True, packed_seq_lens=packed_seq_lens
        )
    return recorder.hidden, output


def scored_positions(token_mask, action_mask):
    """``(rows, columns)``, (k,) each: the (B, A) positions of the tokens scored, ``token_mask`` within
    ``action_mask``. The forward's one host sync, which it cannot do without: k sizes the head call."""
    return (token_mask.bool() & action_mask.bool()).nonzero(as_tuple=True)


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


class NonFiniteCheck:
    """Refuses non-finite log-probs or entropies of the head calls (FloatingPointError naming their source: the
    model's forward up to its LM head, upstream's computation; the head's parameters; or the chunked kernel)
    without making the host wait for the device at every call.

    Each head call adds its counts on the device (:meth:`add`, inside the call, where ZeRO-3 has gathered the
    head); :meth:`raise_if_any` reads them all with one copy, to be called where the host waits for the device
    anyway: after a training step (upstream's ends with a host read; an update made from a NaN then never leaves
    the actor, whose run stops before weights reach vLLM or a checkpoint), or as the experience forward's results
    go to the host. The head's check is one read of its parameters, which the call's forward and backward read
    once per block."""

    def __init__(self, prevents: str = "no NaN reaches the loss") -> None:
        self.prevents = prevents  # what the refusal prevents, for the message: where its owner reads the counts
        self._calls = []  # per head call: tokens scored, (3,) int64 on the device (bad tokens, bad hidden, bad head)

    def add(self, head: torch.nn.Linear, hidden, log_probs, entropy) -> None:
        """Count the non-finite results of one head call ((k,) log-probs and entropy of hidden (k, H)) and the bad
        tokens whose hidden state is non-finite, and note whether the head holds a non-finite parameter: device
        ops only, none with a temporary the size of the head or of the hidden states, and no autograd record."""
        with torch.no_grad():
            finite = torch.isfinite(log_probs)
            if entropy is not None:
                finite &= torch.isfinite(entropy)
            bad = ~finite
            hidden_bad = _non_finite(*torch.aminmax(hidden, dim=-1)) & bad
            params = [p for p in (head.weight, head.bias) if p is not None and p.numel()]
            head_bad = torch.stack([_non_finite(*torch.aminmax(p)) for p in params]).any()
            self._calls.append((finite.numel(), torch.stack([bad.sum(), hidden_bad.sum(), head_bad.long()])))

    def raise_if_any(self) -> None:
        """Raise FloatingPointError for the first head call since the last check with a non-finite result."""
        calls, self._calls = self._calls, []
        if not calls:
            return
        counts = torch.stack([tally for _, tally in calls]).tolist()
        for (total, _), (bad, hidden_bad, head_bad) in zip(calls, counts):
            if bad:
                raise FloatingPointError(_non_finite_message(bad, total, hidden_bad, head_bad, self.prevents))


def _non_finite(minimum, maximum):
    """Where a tensor reduced to its ``aminmax`` holds a non-finite value: NaN propagates through min and max, an
    infinity is one of them (one read of the tensor, no temporary of its size)."""
    return ~(torch.isfinite(minimum) & torch.isfinite(maximum))


def _non_finite_message(bad: int, total: int, hidden_bad: int, head_bad: int, prevents: str) -> str:
    if hidden_bad:
        source = (
            f"the final hidden states are non-finite at {hidden_bad} of them: the model's own forward up to its LM "
            "head (upstream's computation) produced them, and upstream's forward gives the same NaN"
        )
    elif head_bad:
        source = "the LM head's parameters hold non-finite values: upstream's forward gives the same NaN"
    else:
        source = "their hidden states and the LM head are finite: the chunked kernel (core.logprobs) produced them"
    return (
        f"non-finite log-probs or entropy at {bad} of {total} action tokens; {source}. Stopped here so that {prevents}"
    )


def head_log_probs(
    head: torch.nn.Linear,
    hidden,
    targets,
    temperature: float,
    non_finite: NonFiniteCheck,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
):
    """``(log_probs, entropy)`` (k,) fp32 of ``targets`` under softmax(head(hidden) / temperature), from one call
    of the head module whose forward is the chunked kernel (hidden (k, H), targets (k,); ``chunk_size``: the
    kernel's, None for its default); ``entropy`` is None without ``with_entropy``. Non-finite results are counted
    into ``non_finite``, which its owner reads where the host waits anyway (:class:`NonFiniteCheck`)."""

    def chunked(states, ids):
        log_probs, entropy = chunked_logprobs_entropy(
            states,
            head.weight,
            ids,
            bias=head.bias,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )
        non_finite.add(head, states, log_probs, entropy)  # here, where ZeRO-3 has gathered the head
        return log_probs, entropy

    # an instance attribute shadows Linear.forward for nn.Module.__call__, which runs the head's hooks
    own = head.__dict__.get("forward")  # a wrapper's (accelerate's hooks set one), put back afterwards
    head.forward = chunked
    try:
        return head(hidden, targets)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _tensors(value) -> Iterator[torch.Tensor]:
    """The tensors of a model output, nested in dicts, tuples and lists (as the engine's hooks traverse it)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _start_backward_with_the_engine(actor: Actor, output, tensors) -> None:
    """A DeepSpeed engine starts its backward (ZeRO's accumulation boundary, backward bookkeeping, offload swaps)
    from hooks on the outputs of its forward, once per backward (DeepSpeed 0.18.3 on: ``host.DEEPSPEED_RANGE``,
    checked at launch). The log-probs here come from outside that forward, so they get the same hooks: those of the
    engine's own manager where its outputs have one (an MoE aux loss), so that it still starts once. A model
    outside a DeepSpeed engine has none."""
    engine = actor.model
    if not torch.is_grad_enabled() or not hasattr(engine, "_backward_prologue_per_tensor"):
        return
    from deepspeed.runtime.utils import register_output_backward_hooks

    managers = [m for tensor in _tensors(output) for m in getattr(tensor, "_backward_hook_managers", ())]
    if not managers:
        register_output_backward_hooks(tensors, engine._backward_prologue, engine._backward_prologue_per_tensor)
        return
    for tensor in tensors:
        managers[-1].hook_handles.append(tensor.register_hook(managers[-1]._make_backward_hook(tensor)))


def action_log_probs_entropy(
    actor: Actor,
    sequences,
    action_mask,
    attention_mask,
    token_mask,
    packed_seq_lens=None,
    chunk_size=None,
    with_entropy: bool = False,
    non_finite: Optional[NonFiniteCheck] = None,
):
    """Log-probs (and, ``with_entropy``, the entropy) of the ``token_mask`` tokens of a (B, A) action grid without
    full logits. Non-finite ones are counted into ``non_finite``, for its owner to refuse where the host waits
    anyway (the trainer: after the step); None: refused here, before returning (one host sync).

    Returns ``(log_probs, entropy, (rows, columns), output)``: both (k,) fp32 with gradients (``entropy`` None
    without ``with_entropy``), the (B, A) indices of the k tokens, and upstream's model output with empty logits."""
    hidden, output = final_hidden_states(actor, sequences, attention_mask, packed_seq_lens)
    index = scored_positions(token_mask, action_mask)
    states, targets = action_hidden(actor, hidden, sequences, attention_mask, *index, action_mask.shape[1])
    head = causal_lm(actor).get_output_embeddings()
    check = NonFiniteCheck() if non_finite is None else non_finite
    log_probs, entropy = head_log_probs(head, states, targets, actor.temperature, check, chunk_size, with_entropy)
    if non_finite is None:
        check.raise_if_any()
    _start_backward_with_the_engine(actor, output, tuple(t for t in (log_probs, entropy) if t is not None))
    return log_probs, entropy, index, output


def training_forward(
    actor: Actor,
    sequences: torch.LongTensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    log_prob_mask: Optional[torch.Tensor] = None,
    fill_log_probs: Optional[torch.Tensor] = None,
    return_output: bool = False,
    ring_attn_group=None,
    packed_seq_lens=None,
    return_entropy: bool = False,
    non_finite: Optional[NonFiniteCheck] = None,
):
    """Upstream's ``Actor.forward(sequences, action_mask, attention_mask, return_output=..., return_entropy=...)``
    for a training step, with chunked logits (see the module docstring).

    Args:
        sequences, attention_mask: (B, S) as upstream's.
        action_mask: (B, A) response-token mask.
        log_prob_mask: (B, A) bool, the only tokens whose log-probs the loss reads (the kept tokens); None: every
            action token.
        fill_log_probs: with ``log_prob_mask``, (B, A) log-probs returned (detached) at the other action tokens,
            normally the old ones, so that their ratio is exactly 1.
        return_entropy: set ``output.entropy`` (B, S - 1) as upstream's, the entropy (with its gradient) at the
            action positions and 0 elsewhere; only without ``log_prob_mask``. Without it no entropy is computed.
        non_finite: as :func:`action_log_probs_entropy`'s (None: a non-finite log-prob is refused here).

    Returns:
        ``action_log_probs`` (B, A) fp32 (0 outside ``action_mask``), or ``(action_log_probs, output)`` with
        ``return_output``. Upstream's ``output.logits`` is empty (B, 0, V).
    """
    if ring_attn_group is not None:
        raise ValueError("the chunked-logits forward does not support ring attention")
    if log_prob_mask is not None and (return_entropy or fill_log_probs is None):
        raise ValueError(
            "with a log_prob_mask the other action tokens need fill_log_probs, and there is no entropy (the entropy "
            "loss reads every action token: pass log_prob_mask=None)"
        )
    token_mask = action_mask if log_prob_mask is None else log_prob_mask
    log_probs, entropy, index, output = action_log_probs_entropy(
        actor,
        sequences,
        action_mask,
        attention_mask,
        token_mask,
        packed_seq_lens,
        with_entropy=return_entropy,
        non_finite=non_finite,
    )
    if log_prob_mask is None:
        fill = torch.zeros(action_mask.shape, dtype=log_probs.dtype, device=log_probs.device)
    else:
        fill = (fill_log_probs.detach().float() * action_mask).to(log_probs.dtype)
    action_log_probs = fill.index_put(index, log_probs)
    if return_entropy:
        grid = torch.zeros(action_mask.shape, dtype=entropy.dtype, device=entropy.device).index_put(index, entropy)
        prompt = grid.new_zeros(grid.shape[0], sequences.shape[1] - 1 - grid.shape[1])
        output.entropy = torch.cat([prompt, grid], dim=1)
    return (action_log_probs, output) if return_output else action_log_probs
