"""Per-token log-probs of target ids and the policy entropy from final hidden states, without full logits.

For positions t with final hidden state h_t (H,), output embedding W (V, H) and optional bias b (V,):

    z_t = fp32(h_t W^T + b) / temperature                       (logits, as OpenRLHF's Actor.forward forms them)
    log p(y_t) = z_t[y_t] - logsumexp(z_t)                      (OpenRLHF's ``log_probs_from_logits``)
    H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t[v]          (OpenRLHF's ``compute_entropy``)

The matmul runs in the inputs' dtype (as the model's lm_head does), its result is cast to fp32 and divided by
the temperature, exactly the arithmetic of upstream's forward, but on ``chunk_size`` positions at a time, so the
logits never exist beyond one (chunk_size, V) block (plus a few same-size temporaries).

Gradients flow to ``hidden``, ``weight`` and ``bias`` through the log-probs: the backward recomputes each chunk's
logits from the saved inputs and the per-position logsumexp (saved, (N,) fp32), so it too holds one chunk of
logits at a time, plus an fp32 accumulator the size of ``weight`` (and ``bias``) for their gradients. The
entropy is returned detached (not differentiable): it is a diagnostic and a selection score, never a loss term
here; differentiating it would need a second set of per-chunk statistics.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

# chunk_size=None: as many positions per chunk as keep the chunk's fp32 logits and its same-size temporaries
# (softmax, product; about 4 of them) within this budget: 110 positions at a 151,936 vocabulary. Small enough
# that a 1k-token sequence holds well under its full logits, large enough that a chunk is one efficient matmul.
DEFAULT_CHUNK_BUDGET_BYTES = 1 << 28
_TEMPORARIES_PER_CHUNK = 4


def default_chunk_size(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int:
    """Positions per chunk so that ~4 fp32 (chunk, V) tensors fit in ``budget_bytes`` (at least 1)."""
    return max(1, budget_bytes // (_TEMPORARIES_PER_CHUNK * 4 * vocab_size))


def _chunk_logits(hidden, weight, bias, temperature):
    logits = F.linear(hidden, weight, bias).to(torch.float32)
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        # hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> log_probs, entropy, both (N,) fp32
        count = hidden.shape[0]
        log_probs = torch.empty(count, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(log_probs)
        logsumexp = torch.empty_like(log_probs)
        for start in range(0, count, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight, bias, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            logsumexp[rows] = lse
            log_probs[rows] = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse
            entropy[rows] = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy):
        hidden, weight, bias, targets, logsumexp = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logits = _chunk_logits(hidden[rows], weight, bias, ctx.temperature)
            grad_out = grad_log_probs[rows].unsqueeze(-1)
            # d log p(y) / dz = onehot(y) - softmax(z); then through "/ temperature" and the fp32 cast
            grad_logits = torch.exp(logits - logsumexp[rows].unsqueeze(-1)).mul_(-grad_out)
            grad_logits.scatter_add_(-1, targets[rows].unsqueeze(-1), grad_out)
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.t().to(torch.float32), hidden[rows].to(torch.float32))
            if need_bias:
                grad_bias += grad_logits.to(torch.float32).sum(dim=0)
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and the entropy under softmax((hidden W^T + b) / temperature), chunk by chunk.

    Args:
        hidden: final hidden states (..., T, H), floating point (the lm_head's input).
        weight: output embedding (V, H), same dtype and device as ``hidden``.
        targets: token ids (..., T) in [0, V): the token each position predicts.
        bias: optional (V,) output bias (models whose lm_head has one).
        temperature: positive float; the logits are divided by it after the fp32 cast, as upstream does.
        chunk_size: positions per chunk; None picks :func:`default_chunk_size` (a ~256 MiB budget).

    Returns:
        ``(log_probs, entropy)``, both fp32 (..., T). ``log_probs`` is differentiable w.r.t. hidden, weight and
        bias; ``entropy`` is detached.
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 2:
        raise ValueError("hidden must be a floating-point tensor of shape (..., T, H)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(getattr(weight, 'shape', ()))}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) and dtype {weight.dtype}")
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError("targets must be an integer (int64 or int32) tensor of token ids")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    vocab = weight.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"targets must be token ids in [0, {vocab})")

    positions = hidden.shape[:-1]
    # (N, H) and (N,) views; hidden states are V/H times smaller than logits, so a copy of a strided input is cheap
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    log_probs, entropy = _ChunkedLogProbs.apply(
        flat_hidden, weight, bias, flat_targets, float(temperature), int(chunk_size)
    )
    return log_probs.reshape(positions), entropy.reshape(positions)
