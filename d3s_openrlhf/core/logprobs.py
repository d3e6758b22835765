"""Per-token log-probs of target ids and the policy entropy from final hidden states, without full logits.

For positions t with final hidden state h_t (H,), output embedding W (V, H) and optional bias b (V,):

    z_t = fp32(h_t W^T + b) / temperature                       (logits, as OpenRLHF's Actor.forward forms them)
    log p(y_t) = z_t[y_t] - logsumexp(z_t)                      (OpenRLHF's ``log_probs_from_logits``)
    H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t[v]          (OpenRLHF's ``compute_entropy``)

The matmul runs in the inputs' dtype (as the model's lm_head does), its result is cast to fp32 and divided by
the temperature, exactly the arithmetic of upstream's forward, but on ``chunk_size`` positions at a time, so the
logits never exist beyond one (chunk_size, V) block (plus a few same-size temporaries).

Gradients flow to ``hidden``, ``weight`` and ``bias`` through both outputs (the entropy's, for an entropy bonus:
dH/dz_v = -p_v (z_v - logsumexp(z) + H)). The forward goes through the positions ``chunk_size`` rows at a time;
the backward goes through the vocabulary ``vocab_block`` columns at a time, recomputing the (N, vocab_block) logits
of every position from the saved inputs and the per-position logsumexp and entropy (saved, (N,) fp32). So each
block of the weight gradient is one matmul over all positions, written once (no accumulator the size of the
weight), and the hidden-state gradient is summed over the vocabulary blocks in fp32 (each block's product in the
inputs' dtype; (N, H), V/H times smaller than the logits).

Sizes: both blocks come from a byte budget (:func:`chunk_budget_bytes`: 256 MiB on a CPU, a quarter of the free
memory on a GPU: thousands of rows at a 151,936 vocabulary) and cover at most a quarter of the positions (of the
vocabulary), so that a block and its temporaries (at most 4 fp32 copies: one copy of the full logits) stay below
what upstream holds in any forward: its fp32 logits and, at the cast, their copy in the head's dtype (1.5 copies
without gradient; about 2.5 at the peak of a training step with flash-attn's Triton cross-entropy, its fastest).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

# The chunk budget on a CPU and the floor on a GPU: 110 positions per chunk at a 151,936 vocabulary. Small enough
# that a 1k-token sequence holds well under its full logits, large enough that a chunk is one efficient matmul.
DEFAULT_CHUNK_BUDGET_BYTES = 1 << 28
# On a GPU: this share of the memory free to torch's allocator (free on the device plus cached but unused).
CUDA_FREE_MEMORY_SHARE = 0.25
_TEMPORARIES_PER_CHUNK = 4  # fp32 (chunk, V) tensors alive at once: logits, softmax or probabilities, product, cast


def chunk_budget_bytes(device) -> int:
    """Bytes one block of logits and its temporaries may take on ``device`` (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_CHUNK_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(DEFAULT_CHUNK_BUDGET_BYTES, int((free + cached) * CUDA_FREE_MEMORY_SHARE))


def default_chunk_size(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int:
    """Positions per chunk so that ~4 fp32 (chunk, V) tensors fit in ``budget_bytes`` (at least 1)."""
    return max(1, budget_bytes // (_TEMPORARIES_PER_CHUNK * 4 * vocab_size))


def _quarter(count: int) -> int:
    return max(1, math.ceil(count / 4))


def _blocks(count: int, size: int):
    return (slice(start, start + size) for start in range(0, count, size))


def _chunk_logits(hidden, weight, bias, temperature):
    logits = F.linear(hidden, weight, bias).to(torch.float32)
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, vocab_block):
        # hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> log_probs, entropy, both (N,) fp32
        count = hidden.shape[0]
        log_probs = torch.empty(count, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(log_probs)
        logsumexp = torch.empty_like(log_probs)
        for rows in _blocks(count, chunk_size):
            logits = _chunk_logits(hidden[rows], weight, bias, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            logsumexp[rows] = lse
            log_probs[rows] = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse
            entropy[rows] = lse - torch.softmax(logits, dim=-1).mul_(logits).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp, entropy)
        ctx.temperature, ctx.vocab_block = temperature, vocab_block
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) gets no gradient term
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, logsumexp, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        lse = logsumexp.unsqueeze(-1)
        for columns in _blocks(weight.shape[0], ctx.vocab_block):
            block_weight = weight[columns]
            block_bias = None if bias is None else bias[columns]
            logits = _chunk_logits(hidden, block_weight, block_bias, ctx.temperature)  # (N, block) fp32
            probs = torch.exp(logits - lse)
            # d/dz_v: of g * log p(y), g (1[v = y] - p_v); of g' * H, -g' p_v (z_v - logsumexp + H)
            if grad_entropy is not None:
                grad_logits = logits.sub_(lse).add_(entropy.unsqueeze(-1)).mul_(probs)
                grad_logits.mul_(-grad_entropy.unsqueeze(-1))
                if grad_log_probs is not None:
                    grad_logits.addcmul_(probs, grad_log_probs.unsqueeze(-1), value=-1)
            else:
                grad_logits = probs.mul_(-grad_log_probs.unsqueeze(-1))
            del logits, probs
            if grad_log_probs is not None:  # + g at the target, where it falls in this block (no host sync)
                inside = (targets >= columns.start) & (targets < columns.stop)
                local = (targets - columns.start).clamp_(0, grad_logits.shape[1] - 1)
                grad_logits.scatter_add_(-1, local.unsqueeze(-1), (grad_log_probs * inside).unsqueeze(-1))
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            if need_bias:
                grad_bias[columns] = grad_logits.sum(dim=0).to(bias.dtype)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden.add_(grad_logits @ block_weight)
            if need_weight:
                grad_weight[columns] = grad_logits.t() @ hidden
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    vocab_block: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and the entropy under softmax((hidden W^T + b) / temperature), chunk by chunk.

    Args:
        hidden: final hidden states (..., T, H), floating point (the lm_head's input).
        weight: output embedding (V, H), same dtype and device as ``hidden``.
        targets: token ids (..., T) in [0, V): the token each position predicts.
        bias: optional (V,) output bias (models whose lm_head has one).
        temperature: positive float; the logits are divided by it after the fp32 cast, as upstream does.
        chunk_size: positions per chunk of the forward; None: from :func:`chunk_budget_bytes` of the device, at
            most a quarter of the positions.
        vocab_block: vocabulary columns per block of the backward; None: from the same budget, at most a quarter
            of the vocabulary.

    Returns:
        ``(log_probs, entropy)``, both fp32 (..., T), both differentiable w.r.t. hidden, weight and bias.
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
    for name, value in (("chunk_size", chunk_size), ("vocab_block", vocab_block)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    vocab = weight.shape[0]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"targets must be token ids in [0, {vocab})")

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
    log_probs, entropy = _ChunkedLogProbs.apply(
        flat_hidden, weight, bias, flat_targets, float(temperature), int(chunk_size), int(vocab_block)
    )
    return log_probs.reshape(positions), entropy.reshape(positions)
