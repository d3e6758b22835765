"""Per-position policy entropy from logits, computed in chunks to bound peak memory.

H = logsumexp(z) - sum_v softmax(z)_v * z_v, the same formula as OpenRLHF's ``compute_entropy``, evaluated in
fp32 (fp64 inputs stay fp64 during the computation) on at most ``chunk_size`` positions at a time, so the
temporaries beyond the input itself are a few (chunk_size, V) tensors instead of several copies of the whole
(..., T, V) logits, and a non-contiguous input (a slice of larger logits) is read in place, never copied. The
result is returned in fp32. The function is differentiable: under autograd each chunk
keeps what its backward needs (that memory is inherent to differentiating the entropy, chunked or not).
Vocabulary entries with logit -inf (masked out) have probability 0 and contribute 0, instead of the NaN that
0 * -inf would give in the plain formula.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from d3s_openrlhf.core.checks import is_int
from d3s_openrlhf.core.logprobs import default_chunk_size


def entropy_from_logits(logits: torch.Tensor, *, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension.

    Args:
        logits: floating tensor of shape (..., T, V) with V >= 1.
        chunk_size: number of positions (along T, within one leading index) processed at a time; None picks
            ``core.logprobs.default_chunk_size(V)`` (a ~256 MiB budget for the chunk's temporaries).

    Returns:
        fp32 tensor of shape (..., T).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point torch.Tensor")
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., T, V), got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a non-empty vocabulary dimension V")
    if chunk_size is None:
        chunk_size = default_chunk_size(logits.shape[-1])
    if not is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")

    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    positions = logits.shape[:-1]
    if logits.numel() == 0:
        return torch.zeros(positions, dtype=torch.float32, device=logits.device)

    # Slices of the caller's tensor, one leading index and up to chunk_size positions at a time: integer indexing
    # and slicing are views whatever the strides, whereas flattening a non-contiguous view (such as the
    # logits[:, :-1][:, -A:] of an experience forward) would copy all of it.
    parts = []
    for index in itertools.product(*map(range, positions[:-1])):
        row = logits[index]  # (T, V) view
        for start in range(0, row.shape[0], int(chunk_size)):
            chunk = row[start : start + chunk_size].to(compute_dtype)
            probs = torch.softmax(chunk, dim=-1)
            finite_logits = chunk.masked_fill(torch.isneginf(chunk), 0.0)
            parts.append(torch.logsumexp(chunk, dim=-1) - (probs * finite_logits).sum(dim=-1))
    return torch.cat(parts).reshape(positions).to(torch.float32)
