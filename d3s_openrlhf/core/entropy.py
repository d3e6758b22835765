"""Per-position policy entropy from logits, computed in chunks to bound peak memory.

H = logsumexp(z) - sum_v softmax(z)_v * z_v, the same formula as OpenRLHF's ``compute_entropy``, evaluated in
fp32 (fp64 inputs stay fp64 during the computation) on at most ``chunk_size`` positions at a time, so the
temporaries beyond the input itself are a few (chunk_size, V) tensors instead of several copies of the whole
(..., T, V) logits. The input is never copied, also when it is a non-contiguous view (chunks are views of its
(T, V) matrices). The result is returned in fp32. The function is differentiable: under autograd each chunk
keeps what its backward needs (that memory is inherent to differentiating the entropy, chunked or not).
Vocabulary entries with logit -inf (masked out) have probability 0 and contribute 0, instead of the NaN that
0 * -inf would give in the plain formula.
"""

from __future__ import annotations

import numbers

import torch


def entropy_from_logits(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension.

    Args:
        logits: floating tensor of shape (..., T, V) with V >= 1.
        chunk_size: number of positions (rows of the flattened (-1, V) view) processed at a time.

    Returns:
        fp32 tensor of shape (..., T).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point torch.Tensor")
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., T, V), got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a non-empty vocabulary dimension V")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")

    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    # Chunks are taken from the (T, V) matrices of the input as views: reshaping a non-contiguous input (e.g. the
    # action slice logits[:, :-1][:, -A:] of the actor's (B, S, V) logits) to (-1, V) would copy all of it.
    parts = [_matrix_entropy(matrix, int(chunk_size), compute_dtype) for matrix in _matrices(logits)]
    if not parts:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(logits.shape[:-1])


def _matrices(logits: torch.Tensor):
    """The (T, V) matrices of a (..., T, V) tensor, in order, as views."""
    if logits.dim() == 2:
        yield logits
        return
    for sub in logits.unbind(0):
        yield from _matrices(sub)


def _matrix_entropy(matrix: torch.Tensor, chunk_size: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """Entropy (T,) in fp32 of a (T, V) view, chunk_size rows at a time."""
    parts = []
    for start in range(0, matrix.shape[0], chunk_size):
        chunk = matrix[start : start + chunk_size].to(compute_dtype)
        probs = torch.softmax(chunk, dim=-1)
        finite_logits = chunk.masked_fill(torch.isneginf(chunk), 0.0)
        parts.append((torch.logsumexp(chunk, dim=-1) - (probs * finite_logits).sum(dim=-1)).to(torch.float32))
    return torch.cat(parts) if parts else matrix.new_zeros(0, dtype=torch.float32)
