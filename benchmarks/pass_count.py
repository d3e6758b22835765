"""Passes over blocks of logits, counted from the ATen operators torch dispatches while a function runs.

A pass is one operator that reads or writes a tensor of at least ``block`` elements (a (rows, V) block of logits, its
gradient, or a temporary of that size): a matmul that writes the block or reads it, an elementwise operator, a
reduction over the vocabulary, a fill. Not passes: views and allocations (no data moved) and the index operators
that touch one element per row (gather, scatter). ATen's ``logsumexp`` is one operator at the dispatcher but four
kernels inside (``logsumexp_out_impl``: amax, subtract, exp, sum, on every device), and counts as four.

Used by ``bench_forward.py --passes`` (the table in docs/semantics.md) and by the kernel's tests; imports nothing but
torch.
"""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_INDEX = {"gather", "scatter", "scatter_add", "scatter_add_", "scatter_"}
_NO_DATA = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "_unsafe_view"}
_KERNELS_INSIDE = {"logsumexp": ("amax", "sub", "exp_", "sum")}


class _Spy(TorchDispatchMode):
    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block
        self.passes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _INDEX or name in _NO_DATA:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.numel() >= self.block for t in tensors):
            for kernel in _KERNELS_INSIDE.get(name, (name,)):
                self.passes[kernel] += 1
        return out


def block_passes(fn, block: int):
    """``(fn(), Counter of the passes over tensors of >= block elements by operator name)``."""
    with _Spy(block) as spy:
        result = fn()
    return result, spy.passes
