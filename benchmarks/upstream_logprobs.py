"""Upstream's log-prob arithmetic for the forward benchmarks, in its two memory profiles, with torch alone.

OpenRLHF 0.11.2's ``log_probs_from_logits`` takes, for fp32 logits (B, S, V):
* flash-attn's Triton ``cross_entropy_loss`` when it imports (every GPU install with flash-attn): the kernel keeps
  the logits for its backward (no copy) and its per-row statistics, and the backward writes one (N, V) gradient;
* otherwise a torch fallback: ``gather`` minus ``logsumexp`` over chunks of 1024 rows, whose backward builds the
  softmax and its gradient through autograd.

``TritonCrossEntropyProfile`` is the first one's memory profile on any device (no Triton needed): the benchmarks
compare against it, the cheaper of the two, so that "below upstream" means below its fastest path.
``install_triton_profile`` makes upstream's own ``log_probs_from_logits`` find it where it looks for flash-attn's
kernel, so that OpenRLHF's ``Actor.forward`` runs with that profile.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch


def _rowwise_logsumexp(logits: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    # in-kernel on GPU: no (N, V) temporary
    return torch.cat([torch.logsumexp(logits[start : start + rows], dim=-1) for start in range(0, len(logits), rows)])


class TritonCrossEntropyProfile(torch.autograd.Function):
    """-log_softmax(logits)[labels] per row, (N, V) fp32 logits and (N,) labels -> (N,), holding what flash-attn's
    Triton cross-entropy holds: the logits (saved, not copied) and (N,) statistics; one (N, V) gradient in the
    backward."""

    @staticmethod
    def forward(ctx, logits, labels):
        lse = _rowwise_logsumexp(logits)
        ctx.save_for_backward(logits, lse, labels)
        return lse - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, labels = ctx.saved_tensors
        grad = torch.exp(logits - lse.unsqueeze(-1)).mul_(grad_loss.unsqueeze(-1))
        grad.scatter_add_(-1, labels.unsqueeze(-1), -grad_loss.unsqueeze(-1))
        return grad, None


def triton_cross_entropy_profile(logits, labels):
    """The call signature of ``flash_attn.ops.triton.cross_entropy.cross_entropy_loss``: (losses, z_losses)."""
    losses = TritonCrossEntropyProfile.apply(logits, labels)
    return losses, torch.zeros_like(losses)


@contextlib.contextmanager
def install_triton_profile():
    """Within the block ``from flash_attn.ops.triton.cross_entropy import cross_entropy_loss`` (upstream's import
    in ``log_probs_from_logits``) yields :func:`triton_cross_entropy_profile`."""
    name = "flash_attn.ops.triton.cross_entropy"  # a module in sys.modules is imported without its parents
    saved = sys.modules.get(name)
    sys.modules[name] = types.SimpleNamespace(cross_entropy_loss=triton_cross_entropy_profile)
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def upstream_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, triton: bool) -> torch.Tensor:
    """OpenRLHF's ``Actor.forward`` arithmetic from the head's output: fp32 cast, / temperature in place, log-probs
    of ``labels`` by the Triton profile or the torch fallback. logits (N, V), labels (N,) -> (N,)."""
    logits = logits.to(torch.float32)
    if temperature != 1.0:
        logits = logits.div_(temperature)
    if triton:
        return -TritonCrossEntropyProfile.apply(logits, labels)
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - _rowwise_logsumexp(logits)
