"""Per-token log-probs of target ids and the policy entropy from final hidden states, with chunked logits.

For positions t with final hidden state h_t (H,), output embedding W (V, H) and optional bias b (V,):

    z_t = fp32(h_t W^T + b) / temperature                       (logits, as OpenRLHF's Actor.forward forms them)
    log p(y_t) = z_t[y_t] - logsumexp(z_t)                      (OpenRLHF's ``log_probs_from_logits``)
    H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t[v]          (OpenRLHF's ``compute_entropy``; only when asked)

The matmul runs in the inputs' dtype (as the model's lm_head does), its result is cast to fp32 and divided by
the temperature, upstream's arithmetic (the division is folded into the pass that shifts the logits by their
maximum, z * (1/T) - m: one rounding apart from upstream's z / T), but on ``chunk_size`` positions at a time, so the
logits never exist beyond one (chunk_size, V) block (two with the entropy), a buffer that every chunk reuses.

The entropy costs passes over every block, forward and backward; callers ask for it (``with_entropy``) only where
they read it (token selection's scores, an entropy bonus), and the reference forward and a loss of log-probs
alone do the log-prob work alone.

Gradients flow to ``hidden``, ``weight`` and ``bias`` through both outputs (the entropy's, for an entropy bonus:
dH/dz_v = -p_v (z_v - logsumexp(z) + H)). The forward goes through the positions ``chunk_size`` rows at a time;
the backward goes through the vocabulary ``vocab_block`` columns at a time, recomputing the (N, vocab_block) logits
of every position from the saved inputs and the per-position logsumexp and entropy (saved, (N,) fp32). So each
block of the weight gradient is one matmul over all positions, written once (no accumulator the size of the
weight), and the hidden-state gradient is summed over the vocabulary blocks in fp32 (each block's product in the
inputs' dtype; (N, H), V/H times smaller than the logits).

Sizes: both blocks are a function of the shapes and the device type alone (:func:`chunk_budget_bytes`: a fixed byte
budget, 256 MiB on a CPU and 1 GiB on a GPU, never the free memory), so that two processes scoring the same tokens
(the actor's and the reference's forwards, two runs) cut them into the same matmuls and agree bit for bit: at equal
weights the KL is exactly 0 and the entropies (hence the token mask) do not move in their last bits. A block and its
temporaries (at most 4 fp32 copies) stay within the budget and cover at most a quarter of the positions (of the
vocabulary): at a 151,936 vocabulary a forward block is 441 positions on a GPU (110 on a CPU), and its temporaries
at most 1 GiB whatever the length, where upstream's full fp32 logits of 4,096 tokens take 2.5 GB; shorter inputs,
through the quarter cap, hold at most one copy of their full logits. Either way they stay below what upstream holds
in any forward: its fp32 logits and, at the cast, their copy in the head's dtype (1.5 copies without gradient; about
2.5 at the peak of a training step with flash-attn's Triton cross-entropy, its fastest).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from d3s_openrlhf.core.checks import check_on_device, is_int, is_real

# The byte budget of one block of logits and its temporaries. On a CPU: 110 positions per chunk at a 151,936
# vocabulary, small enough that a 1k-token sequence holds well under its full logits, large enough that a chunk is
# one efficient matmul. On a GPU 4 times that (441 positions; a 4k-token micro-batch's backward in 10 vocabulary
# blocks), where smaller blocks would pay the hidden-state gradient's fp32 accumulation once more per block.
DEFAULT_CHUNK_BUDGET_BYTES = 1 << 28
CUDA_CHUNK_BUDGET_BYTES = 1 << 30
_TEMPORARIES_PER_CHUNK = 4  # fp32 (chunk, V) tensors alive at once: logits, softmax or probabilities, product, cast


def chunk_budget_bytes(device) -> int:
    """Bytes one block of logits and its temporaries may take on ``device``: fixed per device type (see the module
    docstring), so that the blocks follow the shapes alone."""
    return CUDA_CHUNK_BUDGET_BYTES if torch.device(device).type == "cuda" else DEFAULT_CHUNK_BUDGET_BYTES


def default_chunk_size(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int:
    """Positions per chunk so that ~4 fp32 (chunk, V) tensors fit in ``budget_bytes`` (at least 1)."""
    return max(1, budget_bytes // (_TEMPORARIES_PER_CHUNK * 4 * vocab_size))


def _quarter(count: int) -> int:
    return max(1, math.ceil(count / 4))


def _blocks(count: int, size: int):
    return (slice(start, start + size) for start in range(0, count, size))


def _logits_into(out, hidden, weight, bias):
    """``out`` (n, v) fp32 <- hidden W^T + b: the matmul in the inputs' dtype, then the fp32 cast, as upstream's head.
    ``out`` is a view of a buffer that every block reuses: torch's CPU allocator keeps no cache, so a fresh (n, v)
    tensor per block would pay its page faults again."""
    if hidden.dtype == torch.float32:  # the matmul writes the block itself (F.linear's kernel: addmm, or mm)
        if bias is None:
            torch.mm(hidden, weight.t(), out=out)
        else:
            torch.addmm(bias, hidden, weight.t(), out=out)
    else:
        out.copy_(F.linear(hidden, weight, bias))
    return out


def _block(buffer, rows, columns):
    """A contiguous (rows, columns) view of the start of the flat ``buffer``."""
    return buffer[: rows * columns].view(rows, columns)


class _ChunkedLogProbs(torch.autograd.Function):
    """Passes over each (rows, V) block (one pass: one kernel that reads or writes the block; how they were
    counted, and upstream's: docs/semantics.md). Forward: the head matmul, max, the shift (z / T - max in one
    pass: the temperature is in it), exp, sum; the entropy adds a second exp (into a second buffer), a multiply and
    a sum. Backward, per (N, vocab_block) block: the matmul again, the shift to the log-softmax, exp, then one
    multiply (log-probs alone) or a multiply-add and a multiply (with the entropy's gradient), and the two gradient
    matmuls. Every pass but the second exp writes into the block it reads."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, vocab_block, with_entropy):
        # hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> log_probs (N,) fp32 [, entropy (N,) fp32]
        count, vocab = hidden.shape[0], weight.shape[0]
        log_probs = torch.empty(count, dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        size = min(chunk_size, count) * vocab
        buffer = torch.empty(size, dtype=torch.float32, device=hidden.device)
        exp_buffer = torch.empty_like(buffer) if with_entropy else None
        for rows in _blocks(count, chunk_size):
            n = min(rows.stop, count) - rows.start
            logits = _logits_into(_block(buffer, n, vocab), hidden[rows], weight, bias)  # z, the head's output
            target_logits = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) / temperature  # u_y = z_y / T
            peak = logits.amax(dim=-1, keepdim=True) / temperature  # m = max_v u_v, for a stable exp
            shifted = torch.add(-peak, logits, alpha=1.0 / temperature, out=logits)  # s = u - m, in place
            if with_entropy:
                exp = torch.exp(shifted, out=_block(exp_buffer, n, vocab))
            else:
                exp = shifted.exp_()
            sum_exp = exp.sum(dim=-1)  # l = sum_v e^s_v
            log_sum = sum_exp.log()  # logsumexp(u) - m
            lse = log_sum + peak.squeeze(-1)
            logsumexp[rows] = lse
            log_probs[rows] = target_logits - lse
            if with_entropy:  # H = logsumexp(u) - sum_v p_v u_v = log l - sum_v e^s_v s_v / l
                entropy[rows] = log_sum - exp.mul_(shifted).sum(dim=-1) / sum_exp
        del buffer, exp_buffer
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp, entropy)
        ctx.temperature, ctx.vocab_block = temperature, vocab_block
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) gets no gradient term
        return (log_probs, entropy) if with_entropy else log_probs

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy=None):
        hidden, weight, bias, targets, logsumexp, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 8
        count, vocab, temperature = hidden.shape[0], weight.shape[0], ctx.temperature
        # z the head's output, s = z / T - logsumexp(z / T) the log-softmax, p = e^s; per row g = dL/dlog p(y),
        # g' = dL/dH: dL/dz_v = [g (1[v = y] - p_v) - g' p_v (s_v + H)] / T = p_v (c0 + c1 s_v) + 1[v = y] g / T
        # with c0 = -(g + g' H) / T and c1 = -g' / T
        g = 0.0 if grad_log_probs is None else grad_log_probs.unsqueeze(-1)
        c0 = -g if grad_entropy is None else -(g + grad_entropy.unsqueeze(-1) * entropy.unsqueeze(-1))
        c0 = c0 / temperature
        c1 = None if grad_entropy is None else -grad_entropy.unsqueeze(-1) / temperature
        target_grad = None if grad_log_probs is None else grad_log_probs / temperature
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        neg_lse = -logsumexp.unsqueeze(-1)
        size = count * min(ctx.vocab_block, vocab)
        buffer = torch.empty(size, dtype=torch.float32, device=hidden.device)
        exp_buffer = torch.empty_like(buffer) if c1 is not None else None
        for columns in _blocks(vocab, ctx.vocab_block):
            width = min(columns.stop, vocab) - columns.start
            block_weight = weight[columns]
            block_bias = None if bias is None else bias[columns]
            logits = _logits_into(_block(buffer, count, width), hidden, block_weight, block_bias)  # z
            log_softmax = torch.add(neg_lse, logits, alpha=1.0 / temperature, out=logits)  # s, in place
            if c1 is None:
                grad_logits = log_softmax.exp_().mul_(c0)
            else:
                probs = torch.exp(log_softmax, out=_block(exp_buffer, count, width))
                grad_logits = torch.addcmul(c0, log_softmax, c1, out=log_softmax).mul_(probs)
            if target_grad is not None:  # + g / T at the target, where it falls in this block (no host sync)
                inside = (targets >= columns.start) & (targets < columns.stop)
                local = (targets - columns.start).clamp_(0, width - 1)
                grad_logits.scatter_add_(-1, local.unsqueeze(-1), (target_grad * inside).unsqueeze(-1))
            if need_bias:
                grad_bias[columns] = grad_logits.sum(dim=0).to(bias.dtype)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden.add_(grad_logits @ block_weight)
            if need_weight:  # written in place, block by block
                torch.mm(grad_logits.t(), hidden, out=grad_weight[columns])
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _check_inputs(hidden, weight, bias, targets, temperature, chunk_size, vocab_block) -> None:
    """Raise ValueError naming the first argument of :func:`chunked_logprobs_entropy` that it cannot take; the
    targets' range on the device, without a host sync (:func:`check_on_device`)."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 2:
        raise ValueError("hidden must be a floating-point tensor of shape (..., T, H)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(getattr(weight, 'shape', ()))}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) and dtype {weight.dtype}")
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError("targets must be an integer (int64 or int32) tensor of token ids")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if not is_real(temperature) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    for name, value in (("chunk_size", chunk_size), ("vocab_block", vocab_block)):
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    in_vocabulary = ((targets >= 0) & (targets < weight.shape[0])).all()
    check_on_device(in_vocabulary, f"targets must be token ids in [0, {weight.shape[0]})")


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    vocab_block: Optional[int] = None,
    with_entropy: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``targets`` (and, when asked, the entropy) under softmax((hidden W^T + b) / temperature), chunk
    by chunk.

    Args:
        hidden: final hidden states (..., T, H), floating point (the lm_head's input).
        weight: output embedding (V, H), same dtype and device as ``hidden``.
        targets: token ids (..., T) in [0, V): the token each position predicts.
        bias: optional (V,) output bias (models whose lm_head has one).
        temperature: positive float; the logits are divided by it after the fp32 cast, as upstream does.
        chunk_size: positions per chunk of the forward; None: from :func:`chunk_budget_bytes` of the device type,
            at most a quarter of the positions.
        vocab_block: vocabulary columns per block of the backward; None: from the same budget, at most a quarter
            of the vocabulary.
        with_entropy: compute the entropy too; without it the kernel does the log-prob work alone (no entropy
            term in the forward or the backward).

    Returns:
        ``(log_probs, entropy)``, both fp32 (..., T), both differentiable w.r.t. hidden, weight and bias;
        ``entropy`` is None without ``with_entropy``.
    """
    _check_inputs(hidden, weight, bias, targets, temperature, chunk_size, vocab_block)
    vocab = weight.shape[0]
    positions = hidden.shape[:-1]
    # (N, H) and (N,) views; hidden states are V/H times smaller than logits, so a copy of a strided input is cheap
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    count = flat_targets.numel()
    budget = chunk_budget_bytes(hidden.device) if chunk_size is None or vocab_block is None else 0
    if chunk_size is None:
        chunk_size = min(default_chunk_size(vocab, budget), _quarter(count))
    if vocab_block is None:
        vocab_block = min(default_chunk_size(max(count, 1), budget), _quarter(vocab))
    outputs = _ChunkedLogProbs.apply(
        flat_hidden, weight, bias, flat_targets, float(temperature), int(chunk_size), int(vocab_block), with_entropy
    )
    if not with_entropy:
        return outputs.reshape(positions), None
    log_probs, entropy = outputs
    return log_probs.reshape(positions), entropy.reshape(positions)
