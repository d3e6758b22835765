"""Sample-level rollout down-sampling (PODS, arXiv 2504.13818; D3S, arXiv 2509.22115).

Given one value per rollout -- ``values`` of shape (B, G): B prompts, G rollouts per prompt; rewards for
PODS, full-group advantages for D3S -- choose which rollouts to keep for the policy update.

Max-variance rule. PODS keeps the size-m subset S maximising the variance of its values,

    S* = argmax_{|S| = m} Var({x_j : j in S}),

and shows that, with x sorted in ascending order x_(1) <= ... <= x_(n), some optimum is the i smallest
together with the m - i largest values (S_i) for an i in {0, ..., m}. Because m is fixed, maximising the
variance is maximising

    score(i) = m * S2(i) - S1(i)^2 = m^2 * Var(S_i),
    S1(i) = P1[i] + P1[n] - P1[n - m + i],   S2(i) = P2[i] + P2[n] - P2[n - m + i],

where P1, P2 are the prefix sums (with P[0] = 0) of the sorted values and of their squares. The score is
unimodal in i (``_max_var_split``), so one prefix sum finds the best i and every tied one in O(m) after the
sort: a row costs O(n log n); PODS's published code re-evaluates each candidate in O(m). Only the m smallest
and the m largest values can be part of a candidate (all n when 2m >= n). The arithmetic is float64 on
centred values, so near-ties are resolved like an exact search would resolve them.

Scopes. ``"intra"`` keeps exactly ``keep`` rollouts of every prompt (PODS, D3S-I), all rows at once as
tensor ops. ``"cross"`` (D3S default) pools the B*G values (each already normalised within its own group
when they are advantages) and keeps ``keep`` in total (about N*B), so a prompt may keep many, few or none.

Ties. With binary rewards most values are equal. Equal values are kept in a uniformly random order drawn
from ``generator`` (independently per row for intra): a tied rollout is not favoured by its position, and
the same generator state gives the same selection. Intra scope and the random rule stably sort the values
after a random permutation; cross scope with max_var or max_reward sorts the values alone (the kept set is
the ``split`` smallest and the ``keep - split`` largest: every value beyond the two boundary values, plus a
uniformly drawn subset of the values equal to each boundary value). When several split points i reach the
optimal score (up to steps of 1e-10 * m * range^2, e.g. 3 successes and 3 failures with m = 3: {1, 0, 0}
and {1, 1, 0} have the same variance), one of them is drawn uniformly from ``generator`` as well, so neither
successes nor failures are systematically preferred. Our choice; the papers are silent on ties.

Devices and threads. The randomness is always drawn on the generator's device (a CPU generator with CUDA
values works) and moved to the values' device, so the same generator state gives the same selection on
every device. On CPU the work runs on one torch thread: torch's OpenMP sort and randperm slow down by tens
of times on two cores when another process competes for them (measured: benchmarks/RESULTS_selection.md),
while these small ops gain nothing from a second thread; and cross scope sorts, compares and finds the kept
positions in numpy, whose vectorised sort of the values alone is several times faster than torch's CPU sort.
The result does not depend on the thread count.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Union

import numpy as np
import torch

from d3s_openrlhf.core.checks import is_int

SAMPLE_SCOPES = ("intra", "cross")

# A step between neighbouring splits that changes the score by at most this fraction of m * span^2 (span: the
# row's range; m^2 * span^2 / 4 bounds every score) leaves them tied. It is far above the float64 rounding of a
# step (about m^2 * 1.1e-16 * span^2 in the worst case, m^1.5 * 1.1e-16 * span^2 typically) and, summed over
# at most m steps, far below any variance difference that matters.
_SCORE_RTOL = 1e-10


def _validate(values: torch.Tensor, keep, scope: str, rule: str) -> int:
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 2 or values.numel() == 0:
        raise ValueError(f"values must be 2-D (B prompts, G rollouts), non-empty, got shape {tuple(values.shape)}")
    if not values.is_floating_point():
        raise ValueError(f"values must be a floating-point tensor, got dtype {values.dtype}")
    if scope not in SAMPLE_SCOPES:
        raise ValueError(f"scope must be one of {SAMPLE_SCOPES}, got {scope!r}")
    if rule not in SELECTION_RULES:
        raise ValueError(f"rule must be one of {tuple(SELECTION_RULES)}, got {rule!r}")
    if not is_int(keep):
        raise TypeError(f"keep must be an int, got {keep!r}")
    keep = int(keep)
    num_prompts, group_size = values.shape
    limit = group_size if scope == "intra" else num_prompts * group_size
    if keep < 1 or keep > limit:
        bound = "G" if scope == "intra" else "B*G"
        raise ValueError(
            f"keep must be in [1, {bound}] = [1, {limit}] for scope={scope!r} and values of shape "
            f"{tuple(values.shape)}, got {keep}"
        )
    low, high = torch.aminmax(values)  # NaN propagates into both
    if not (math.isfinite(low.item()) and math.isfinite(high.item())):
        raise ValueError("values contain NaN or inf")
    return keep


def _order_preserving_bits(x: torch.Tensor) -> torch.Tensor:
    """Integer keys with the same order as the float values of x, exactly.

    Integer sorts are several times faster than float sorts on CPU (torch radix-sorts 1-D integer tensors),
    one pass per key byte: dtypes of at most 32 bits are widened to float32 (exact) and keyed as int32,
    float64 as int64. Flipping the magnitude bits of negative numbers makes the signed
    integer order the float order; adding 0.0 turns -0.0 into +0.0, so the two zeros tie as they do as
    floats.
    """
    if x.element_size() <= 4:
        bits = (x.to(torch.float32) + 0.0).view(torch.int32)
        return bits ^ ((bits >> 31) & 0x7FFF_FFFF)
    bits = (x.to(torch.float64) + 0.0).view(torch.int64)
    return bits ^ ((bits >> 63) & 0x7FFF_FFFF_FFFF_FFFF)


def _random_device(generator, device: torch.device) -> torch.device:
    """Where random draws happen: on the generator's device (a generator only draws there), else on ``device``."""
    return generator.device if generator is not None else device


def _randperm(count: int, generator, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    return torch.randperm(count, generator=generator, dtype=dtype, device=_random_device(generator, device)).to(device)


def _rand(count: int, generator, device: torch.device) -> torch.Tensor:
    """count uniform float64 draws in [0, 1): 53 random bits each."""
    draws = torch.rand(count, generator=generator, dtype=torch.float64, device=_random_device(generator, device))
    return draws.to(device)


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """Run the block's CPU ops on one torch thread (see the module docstring: threads only hurt here)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _ascending_order(x: torch.Tensor, generator) -> torch.Tensor:
    """order (R, n): flat indices into x (R, n) such that x.reshape(-1)[order[r]] is row r ascending, equal
    values in uniformly random order (independently across rows).

    All R * n values are visited in one uniformly random order, stably sorted by value, then stably sorted by
    row; the random order restricted to the ties of one row is again uniform. Only 1-D integer sorts, which
    torch radix-sorts (from 32768 elements on), with keys as narrow as possible.
    """
    rows, n = x.shape
    index_dtype = torch.int32 if rows * n <= torch.iinfo(torch.int32).max else torch.int64  # less to move
    order = _randperm(rows * n, generator, x.device, index_dtype)
    key = _order_preserving_bits(x).reshape(-1)
    order = order.index_select(0, key.index_select(0, order).sort(stable=True).indices)
    if rows > 1:
        row_dtype = torch.int16 if rows <= torch.iinfo(torch.int16).max else torch.int32
        row = torch.arange(rows, dtype=row_dtype, device=x.device).unsqueeze(1).expand(rows, n).reshape(-1)
        order = order.index_select(0, row.index_select(0, order).sort(stable=True).indices)
    return order.view(rows, n)


def _max_var_split(ends: torch.Tensor, m: int, generator, use_numpy: bool | None = None) -> torch.Tensor:
    """Best split i (R,): keep the i smallest and the m - i largest values of each row.

    ends (R, w), each row ascending: the m smallest values of the row followed by its m largest (w = 2m), or
    the whole sorted row (w = n) when 2m >= n. Candidate i is ends[:, :i] + ends[:, w - m + i:].

    Going from split i to i + 1 adds a_i = ends[:, i] and removes b_i = ends[:, w - m + i] (a_i <= b_i), which
    changes score(i) = m * S2(i) - S1(i)^2 by

        delta_i = (a_i - b_i) * g_i,   g_i = m * (a_i + b_i) - (a_i - b_i) - 2 * S1(i).

    g is non-decreasing in i (a and b are, S1 is not increasing), so delta_i >= 0 while g_i < 0 and <= 0 after:
    the score is unimodal, with its maximum at i* = #{i : g_i < 0}. The optimal splits are the run around i*
    of steps that change the score by at most ``_SCORE_RTOL * m * span^2`` (span: the row's range); one of them
    is drawn uniformly. One prefix sum (S1) per row. ``use_numpy`` (default: on CPU) runs the same arithmetic
    on numpy arrays, in fewer and faster passes than torch's on one CPU thread.
    """
    rows, w = ends.shape
    draws = _rand(rows, generator, ends.device)  # (R,) one uniform draw per row for its tied optima
    x = ends.to(torch.float64)
    if use_numpy is None:
        use_numpy = ends.device.type == "cpu"
    if use_numpy:
        x, draws, steps = x.numpy(), draws.numpy(), np.arange(m)
    else:
        steps = torch.arange(m, device=ends.device)
    x = x - (x[:, :1] + x[:, -1:]) / 2  # centred on the mid-range: small sums, no cancellation
    a, b = x[:, :m], x[:, w - m :]
    d = a - b
    s1 = d.cumsum(axis=1) - d + b.sum(axis=1, keepdims=True)  # S1(i), i < m
    g = (a + b) * m - d - 2 * s1
    span = x[:, -1:] - x[:, :1]
    changes = abs(d * g) > _SCORE_RTOL * m * span * span  # steps that change the score
    best = (g < 0).sum(axis=1, keepdims=True)  # i*
    before = (changes & (steps < best)).sum(axis=1, keepdims=True)  # changing steps before i*
    counted = changes.cumsum(axis=1)
    low = (counted < before).sum(axis=1) + (before[:, 0] > 0)  # one past the last changing step before i*
    high = (counted <= before).sum(axis=1)  # the first changing step from i* on (m if none)
    tied = draws * (high - low + 1)
    split = low + (tied.astype(np.int64) if isinstance(tied, np.ndarray) else tied.long())
    return torch.as_tensor(split, device=ends.device)


@dataclass(frozen=True)
class SelectionRule:
    """What a rule keeps of a row: with the row in ascending order (of its values, or of a uniformly random order
    when ``shuffled``), the ``split`` first and the ``keep - split`` last.

    ``split(ends, keep, generator, use_numpy)`` returns an int or an (R,) tensor; ``ends()`` gives the rows'
    ``keep`` smallest and ``keep`` largest values, ascending (the whole row when 2 * keep >= n), only for the
    rules that need them.
    """

    shuffled: bool
    split: Callable[..., Union[int, torch.Tensor]]


def _split_max_var(ends, keep, generator, use_numpy):
    return _max_var_split(ends(), keep, generator, use_numpy)


def _split_max_reward(ends, keep, generator, use_numpy):
    return 0  # the keep largest


def _split_random(ends, keep, generator, use_numpy):
    return keep  # the keep first of a uniformly random order


SELECTION_RULES: Mapping[str, SelectionRule] = MappingProxyType(
    {
        "max_var": SelectionRule(shuffled=False, split=_split_max_var),
        "max_reward": SelectionRule(shuffled=False, split=_split_max_reward),
        "random": SelectionRule(shuffled=True, split=_split_random),
    }
)
"""The sample-level rules: max_var (PODS max-variance, D3S sample level), and PODS's ablation rules max_reward and
random."""


def _select_extremes(x: torch.Tensor, keep: int, rule: str, generator, use_numpy: bool) -> torch.Tensor:
    """Cross scope, a rule that ranks the values themselves (max_var, max_reward), on x (n,): the kept flat
    indices, ascending.

    The kept set is the ``split`` smallest and the ``keep - split`` largest values (split = 0 for max_reward),
    so only the sorted values are needed, not the sorting permutation: every value beyond the two boundary
    values is kept, and the rest of each side's count is drawn uniformly from the values equal to its boundary
    value -- the same distribution as ranking equal values in a uniformly random order. ``use_numpy`` (CPU
    tensors only) does the sort, the split's arithmetic, comparisons and nonzero in numpy, several times
    faster than torch's CPU ops on one thread; the result is the same.
    """
    n, device = x.numel(), x.device
    if use_numpy:
        # widening the 16-bit dtypes to float32 is exact
        x = (x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)).numpy()
        xs = torch.from_numpy(np.sort(x))
        flatnonzero, count, as_index = np.flatnonzero, np.count_nonzero, torch.Tensor.numpy
    else:
        xs = x.sort().values
        flatnonzero, count = (lambda a: a.nonzero().squeeze(1)), (lambda a: int(a.sum()))
        as_index = lambda index: index.to(device)  # noqa: E731

    def ends():
        # only the keep smallest and the keep largest can be part of a candidate
        return (xs if 2 * keep >= n else torch.cat([xs[:keep], xs[n - keep :]])).unsqueeze(0)

    split = int(SELECTION_RULES[rule].split(ends, keep, generator, use_numpy))
    high = keep - split
    low_value = xs[split - 1].item() if split else -math.inf
    high_value = xs[n - high].item() if high else math.inf
    below, above = x < low_value, x > high_value
    ties = {}  # boundary value -> how many of the values equal to it are kept
    if split:
        ties[low_value] = split - count(below)
    if high:
        ties[high_value] = ties.get(high_value, 0) + high - count(above)
    kept = below | above
    for value, need in ties.items():
        equal = flatnonzero(x == value)
        kept[equal[as_index(_randperm(len(equal), generator, device)[:need])]] = True
    kept = flatnonzero(kept)
    return torch.from_numpy(kept) if use_numpy else kept


def _select(values: torch.Tensor, keep: int, scope: str, rule: str, generator) -> torch.Tensor:
    """select_rollouts after validation."""
    x = values.detach()
    selection_rule = SELECTION_RULES[rule]
    if scope == "cross" and not selection_rule.shuffled:
        return _select_extremes(x.reshape(-1), keep, rule, generator, use_numpy=x.device.type == "cpu")
    if scope == "cross":
        x = x.reshape(1, -1)
    rows, n = x.shape
    # A uniformly random order of each row is the ascending order of all-equal values.
    order = _ascending_order(x.new_zeros(x.shape, dtype=torch.float32) if selection_rule.shuffled else x, generator)

    def ends():
        # only the keep smallest and the keep largest of a row can be part of a candidate
        positions = order if 2 * keep >= n else torch.cat([order[:, :keep], order[:, n - keep :]], dim=1)
        return x.reshape(-1).index_select(0, positions.reshape(-1)).view(rows, -1)

    split = selection_rule.split(ends, keep, generator, None)
    if isinstance(split, torch.Tensor):
        split = split.unsqueeze(1)  # (R, 1)
    ranks = torch.arange(keep, device=x.device).unsqueeze(0)  # (1, keep): which sorted positions to keep
    ranks = ranks + (ranks >= split) * (n - keep)  # the split smallest and the keep - split largest
    kept = order.gather(1, ranks.expand(rows, keep))  # (R, keep) flat indices, row r's in [r*n, (r+1)*n)
    if rows > 1:  # sorting each row sorts the whole
        return kept.sort(dim=1).values.reshape(-1).long()
    mask = torch.zeros(n, dtype=torch.bool, device=x.device)  # cheaper than sorting one long row
    return mask.index_fill_(0, kept[0].long(), True).nonzero().squeeze(1)


def select_rollouts(
    values: torch.Tensor,
    keep: int,
    *,
    scope: str = "cross",
    rule: str = "max_var",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose the rollouts to keep.

    Args:
        values: (B, G) finite floating-point tensor; row b holds the values of prompt b's G rollouts.
        keep: rollouts kept per prompt for ``scope="intra"`` (1 <= keep <= G), in total for
            ``scope="cross"`` (1 <= keep <= B*G).
        scope: ``"intra"`` (select within each row) or ``"cross"`` (select from the pooled B*G values).
        rule: ``"max_var"`` (exact maximum-variance subset, see the module docstring), ``"max_reward"``
            (the ``keep`` largest values) or ``"random"`` (uniform without replacement).
        generator: source of all randomness (tie-breaking order, tied optima, the random rule); the same
            generator state gives the same result. None uses torch's global generator.

    Returns:
        1-D int64 tensor on ``values.device`` of sorted flat indices into ``values.reshape(-1)``: B*keep
        entries for intra (row b's entries lie in [b*G, (b+1)*G)), ``keep`` entries for cross.

    Raises:
        ValueError: non-2-D or non-floating values, NaN/inf, keep out of range, unknown scope or rule.
        TypeError: values not a tensor, keep not an integer.
    """
    # Inference mode skips autograd and version-counter bookkeeping on every op; the clone returns an
    # ordinary tensor (inference tensors cannot be saved for backward, e.g. as the index of an index_select).
    with torch.inference_mode(), _one_cpu_thread(getattr(values, "device", torch.device("cpu"))):
        keep = _validate(values, keep, scope, rule)
        kept = _select(values, keep, scope, rule, generator)
    return kept.clone()


_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one step's selection (its tie-breaks and the random rule): a pure function of (seed, step),
    so resumes replay them. It is the selection's alone: the generation level's decisions read
    :func:`keyed_uniform`, so they neither shift nor mirror the selection's draws.

    torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so (seed, step) are mixed by SplitMix64's
    finaliser and folded to 32 bits: a different seed or step gives different draws (packing seed << 32 | step
    made every seed draw alike).
    """
    x = ((((int(seed) & _MASK32) << 32) | (int(step) & _MASK32)) + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    generator = torch.Generator()
    generator.manual_seed((x ^ (x >> 32)) & _MASK32)
    return generator


def keyed_uniform(seed: int, stream: str, *key) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, stream, key): a decision that reads it is the same
    whenever and in whatever order it is taken (the generation level's skip decisions). Distinct streams (e.g.
    ``"skip"``) and keys draw independently; ``key`` holds ints and strings, e.g. (batch, prompt key, occurrence of
    the prompt in the batch)."""
    digest = hashlib.blake2b(repr((int(seed), stream, *key)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53  # 53 bits: every float64 draw is exact
