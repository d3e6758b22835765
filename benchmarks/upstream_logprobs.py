"""Upstream's log-prob arithmetic for the forward benchmarks, in its two memory profiles, with torch alone.

OpenRLHF 0.11.2's ``log_probs_from_logits`` takes, for fp32 logits (B, S, V):
* flash-attn's Triton ``cross_entropy_loss`` when it imports (every GPU install with flash-attn): the kernel keeps
  the logits for its backward (no copy) and its per-row statistics, and the backward writes one (N, V) gradient;
* otherwise a torch fallback: ``gather`` minus ``logsumexp`` over chunks of 1024 rows, whose backward builds the
  softmax and its gradient through autograd.

``TritonCrossEntropyProfile`` is the first one's memory profile on any device (no Triton needed): the CPU
benchmarks compare against it, the cheaper of the two, so that "below upstream" means below its fastest path.
``install_triton_profile`` makes upstream's own ``log_probs_from_logits`` find it where it looks for flash-attn's
kernel, so that OpenRLHF's ``Actor.forward`` runs with that profile.

The GPU benchmarks run upstream's own code instead: ``upstream_path`` says which of the two paths it takes on a
device, and ``torch_fallback`` makes it take the second one (on a CPU, where the Triton kernel, if it imports,
refuses CPU tensors).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Optional

import torch

TRITON_MODULE = "flash_attn.ops.triton.cross_entropy"
"""Where upstream's ``log_probs_from_logits`` imports flash-attn's Triton cross-entropy from."""


def triton_import_error() -> Optional[str]:
    """None where flash-attn's Triton cross-entropy imports, else why not."""
    try:
        importlib.import_module(TRITON_MODULE)
    except Exception as error:  # ImportError, or a flash-attn build that fails on import
        return f"{type(error).__name__}: {error}"
    return None


def upstream_path(device) -> str:
    """The log-prob path upstream's ``log_probs_from_logits`` takes for fp32 logits on ``device`` (under
    :func:`torch_fallback` where that is not the Triton kernel)."""
    if torch.device(device).type != "cuda":
        return "torch fallback (not CUDA: flash-attn's Triton kernel runs on CUDA tensors only)"
    error = triton_import_error()
    return "flash-attn Triton cross-entropy" if error is None else f"torch fallback (flash-attn's kernel: {error})"


@contextlib.contextmanager
def _module_as(name, module):
    """Within the block ``import name`` yields ``module`` (None: raises ImportError); a module in sys.modules is
    imported without its parents."""
    missing = object()
    saved = sys.modules.get(name, missing)
    sys.modules[name] = module
    try:
        yield
    finally:
        if saved is missing:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def torch_fallback():
    """Within the block upstream's ``log_probs_from_logits`` takes its torch fallback (its import of flash-attn's
    kernel raises ImportError)."""
    return _module_as(TRITON_MODULE, None)


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


def install_triton_profile():
    """Within the block ``from flash_attn.ops.triton.cross_entropy import cross_entropy_loss`` (upstream's import
    in ``log_probs_from_logits``) yields :func:`triton_cross_entropy_profile`."""
    return _module_as(TRITON_MODULE, types.SimpleNamespace(cross_entropy_loss=triton_cross_entropy_profile))
