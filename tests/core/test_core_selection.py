import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.selection import keyed_uniform, select_rollouts, step_generator

PROPERTY = settings(max_examples=200, deadline=None)
SCOPES = ("intra", "cross")
RULES = ("max_var", "max_reward", "random")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def pvar(xs) -> float:
    """Population variance, mean-centred, with exactly rounded sums."""
    xs = list(xs)
    mean = math.fsum(xs) / len(xs)
    return math.fsum((x - mean) ** 2 for x in xs) / len(xs)


def brute_force_best(xs, m) -> float:
    return max(pvar(subset) for subset in itertools.combinations(xs, m))


def assert_variance_optimal(got: float, best: float, everything) -> None:
    # The implementation treats split points within 1e-10 of the row's scale as tied; allow a little more.
    scale = max(best, pvar(everything))
    assert abs(got - best) <= 1e-8 * scale + 1e-12, (got, best)


def assert_valid_indices(idx: torch.Tensor, count: int, total: int) -> None:
    assert idx.dtype == torch.int64 and idx.dim() == 1
    assert idx.numel() == count
    if count > 1:
        assert bool((idx[1:] > idx[:-1]).all()), "indices must be sorted and unique"
    assert int(idx.min()) >= 0 and int(idx.max()) < total


def per_row(idx: torch.Tensor, rows: int, group_size: int) -> list[list[int]]:
    """Column indices of the kept members of each row, in order."""
    out = [[] for _ in range(rows)]
    for flat in idx.tolist():
        out[flat // group_size].append(flat % group_size)
    return out


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def value_matrices(draw, max_rows: int, max_cols: int, max_total: int):
    """(B, G) tensors: real values, heavily tied binary/ternary values, group-normalised binary rewards
    (the D3S cross-scope case: equal values across rows), near-ties, and values far from 0 (cancellation in
    naive sums of squares); in several float dtypes."""
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, min(max_cols, max_total // rows)))
    kind = draw(st.sampled_from(["real", "binary", "ternary", "advantages", "near_ties", "offset"]))
    if kind == "real":
        element = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
    elif kind == "binary":
        element = st.sampled_from([0.0, 1.0])
    elif kind == "ternary":
        element = st.sampled_from([-1.0, 0.0, 1.0])
    elif kind == "advantages":
        element = st.sampled_from([0.0, 1.0])
    elif kind == "near_ties":
        element = st.builds(lambda a, b: a + b, st.sampled_from([0.0, 1.0]), st.floats(-1e-9, 1e-9))
    else:
        element = st.floats(-1.0, 1.0).map(lambda v: v + 1e4)
    flat = draw(st.lists(element, min_size=rows * cols, max_size=rows * cols))
    values = torch.tensor(flat, dtype=torch.float64).view(rows, cols)
    if kind == "advantages":  # GRPO's (r - mean) / (std + eps), unbiased std, per row
        std = values.std(dim=1, keepdim=True) if cols > 1 else torch.zeros(rows, 1, dtype=torch.float64)
        values = (values - values.mean(dim=1, keepdim=True)) / (std + 1e-6)
    return values.to(draw(st.sampled_from(DTYPES)))


# ── max_var: exact optimum ──


@PROPERTY
@given(values=value_matrices(max_rows=4, max_cols=12, max_total=12), data=st.data(), seed=st.integers(0, 2**32))
def test_max_var_cross_matches_brute_force(values, data, seed):
    n = values.numel()
    keep = data.draw(st.integers(1, n))
    idx = select_rollouts(values, keep, scope="cross", rule="max_var", generator=gen(seed))
    assert_valid_indices(idx, keep, n)
    flat = values.reshape(-1).double().tolist()
    got = pvar(flat[i] for i in idx.tolist())
    assert_variance_optimal(got, brute_force_best(flat, keep), flat)


@PROPERTY
@given(values=value_matrices(max_rows=4, max_cols=10, max_total=40), data=st.data(), seed=st.integers(0, 2**32))
def test_max_var_intra_matches_brute_force_per_row(values, data, seed):
    rows, cols = values.shape
    keep = data.draw(st.integers(1, cols))
    idx = select_rollouts(values, keep, scope="intra", rule="max_var", generator=gen(seed))
    assert_valid_indices(idx, rows * keep, rows * cols)
    table = values.double().tolist()
    for row, kept in zip(table, per_row(idx, rows, cols)):
        assert len(kept) == keep
        assert_variance_optimal(pvar(row[c] for c in kept), brute_force_best(row, keep), row)


def direct_best_split_variance(sorted_values: torch.Tensor, m: int) -> float:
    """Best variance over the PODS candidates (i smallest + m - i largest), each computed directly."""
    n = sorted_values.numel()
    best = 0.0
    for i in range(m + 1):
        candidate = torch.cat([sorted_values[:i], sorted_values[n - (m - i) :]])
        best = max(best, candidate.var(unbiased=False).item())
    return best


@pytest.mark.parametrize("kind", ["normal", "advantages"])
@pytest.mark.parametrize("seed", [0, 1])
def test_max_var_is_exact_at_scale(kind, seed):
    """(512, 64): tens of thousands of values (torch's radix-sort path) with many near-equal candidate
    variances; float64 scoring still finds the best candidate."""
    g = gen(seed)
    if kind == "normal":  # far from 0, so naive float32 sums of squares would lose the differences
        values = torch.randn(512, 64, generator=g) + 1e3
    else:  # binary rewards, group-normalised: few distinct values, many exact ties across rows
        rewards = (torch.rand(512, 64, generator=g) < torch.rand(512, 1, generator=g)).double()
        values = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).float()
    idx = select_rollouts(values, 8192, scope="cross", generator=g)
    assert_valid_indices(idx, 8192, values.numel())
    pooled = values.reshape(-1).double()
    got = pooled[idx].var(unbiased=False).item()
    best = direct_best_split_variance(pooled.sort().values, 8192)
    assert got >= best - 1e-9 * best
    idx = select_rollouts(values, 16, scope="intra", generator=g)
    assert_valid_indices(idx, 512 * 16, values.numel())
    kept = values.double().reshape(-1)[idx].view(512, 16)
    assert bool((idx.view(512, 16) // 64 == torch.arange(512).unsqueeze(1)).all())
    for row, kept_row in zip(values.double(), kept):
        best = direct_best_split_variance(row.sort().values, 16)
        assert kept_row.var(unbiased=False).item() >= best - 1e-9 * best


# ── max_reward and random ──


@PROPERTY
@given(values=value_matrices(max_rows=5, max_cols=10, max_total=40), data=st.data(), seed=st.integers(0, 2**32))
def test_max_reward_keeps_the_largest_values(values, data, seed):
    rows, cols = values.shape
    table = values.double().tolist()
    scope = data.draw(st.sampled_from(SCOPES))
    if scope == "cross":
        keep = data.draw(st.integers(1, rows * cols))
        idx = select_rollouts(values, keep, scope="cross", rule="max_reward", generator=gen(seed))
        assert_valid_indices(idx, keep, rows * cols)
        flat = sum(table, [])
        assert sorted(flat[i] for i in idx.tolist()) == sorted(flat)[-keep:]
    else:
        keep = data.draw(st.integers(1, cols))
        idx = select_rollouts(values, keep, scope="intra", rule="max_reward", generator=gen(seed))
        assert_valid_indices(idx, rows * keep, rows * cols)
        for row, kept in zip(table, per_row(idx, rows, cols)):
            assert sorted(row[c] for c in kept) == sorted(row)[-keep:]


@PROPERTY
@given(values=value_matrices(max_rows=5, max_cols=10, max_total=40), data=st.data(), seed=st.integers(0, 2**32))
def test_random_counts_and_indices(values, data, seed):
    rows, cols = values.shape
    scope = data.draw(st.sampled_from(SCOPES))
    keep = data.draw(st.integers(1, cols if scope == "intra" else rows * cols))
    idx = select_rollouts(values, keep, scope=scope, rule="random", generator=gen(seed))
    assert_valid_indices(idx, rows * keep if scope == "intra" else keep, rows * cols)
    if scope == "intra":
        assert all(len(kept) == keep for kept in per_row(idx, rows, cols))


def chi_square_critical(df: int, z: float = 5.0) -> float:
    """Upper quantile of chi^2(df) at the standard-normal z (Wilson-Hilferty); z = 5 is p ~ 3e-7."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def assert_uniform(counts: Counter, outcomes: set, draws: int) -> None:
    assert set(counts) == outcomes, f"expected exactly the outcomes {sorted(outcomes)}, saw {sorted(counts)}"
    expected = draws / len(outcomes)
    stat = sum((counts[o] - expected) ** 2 / expected for o in outcomes)
    assert stat < chi_square_critical(len(outcomes) - 1), (stat, counts)


def subset_frequencies(values, keep, scope, rule, draws, seed=1234):
    g = gen(seed)
    picks = (select_rollouts(values, keep, scope=scope, rule=rule, generator=g) for _ in range(draws))
    return Counter(tuple(idx.tolist()) for idx in picks)


def test_random_is_uniform_over_subsets_cross():
    values = torch.arange(6, dtype=torch.float32).view(2, 3)
    counts = subset_frequencies(values, 2, "cross", "random", draws=3000)
    assert_uniform(counts, set(itertools.combinations(range(6), 2)), 3000)


def test_random_is_uniform_over_subsets_intra():
    values = torch.arange(10, dtype=torch.float32).view(2, 5)
    counts = subset_frequencies(values, 2, "intra", "random", draws=3000)
    for row in range(2):
        row_counts = Counter(kept[2 * row : 2 * row + 2] for kept in counts.elements())
        assert_uniform(row_counts, set(itertools.combinations(range(5 * row, 5 * row + 5), 2)), 3000)


# ── ties ──


TIE_CASES = {
    # values, keep, scope, rule, every optimal subset (each must be equally likely)
    "max_reward: two of four tied maxima": (
        [[0.0, 1.0, 1.0, 1.0, 1.0]],
        2,
        "intra",
        "max_reward",
        set(itertools.combinations(range(1, 5), 2)),
    ),
    "max_reward: -0.0 ties +0.0": ([[-0.0, 0.0, -0.0]], 1, "cross", "max_reward", {(0,), (1,), (2,)}),
    "max_var: one success and one failure": (
        [[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]],
        2,
        "intra",
        "max_var",
        {(a, b) for a in range(3) for b in range(3, 6)},
    ),
    "max_var: 1-1-0 and 1-0-0 are equally good": (
        [[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]],
        3,
        "intra",
        "max_var",
        {c for c in itertools.combinations(range(6), 3) if 0 < sum(i < 3 for i in c) < 3},
    ),
    "max_var: prompts break their ties independently": (
        [[5.0] * 4, [5.0] * 4],
        1,
        "intra",
        "max_var",
        {(a, b) for a in range(4) for b in range(4, 8)},
    ),
    "max_var: all equal": ([[2.0, 2.0, 2.0, 2.0]], 2, "intra", "max_var", set(itertools.combinations(range(4), 2))),
    "max_var: equal advantages across prompts": (
        [[1.0, -1.0], [1.0, -1.0], [1.0, -1.0]],
        2,
        "cross",
        "max_var",
        {tuple(sorted((a, b))) for a in (0, 2, 4) for b in (1, 3, 5)},
    ),
}


@pytest.mark.parametrize("case", sorted(TIE_CASES))
def test_ties_are_broken_uniformly_at_random(case):
    values, keep, scope, rule, optimal = TIE_CASES[case]
    draws = 120 * len(optimal)
    counts = subset_frequencies(torch.tensor(values), keep, scope, rule, draws=draws)
    assert_uniform(counts, optimal, draws)


@pytest.mark.parametrize("scope", SCOPES)
def test_ties_are_broken_uniformly_at_scale(scope):
    """All 32768 values equal (torch's radix-sort path): picks spread evenly over positions. Intra: over the
    64 columns (one pick per row); cross: over 64 blocks of 512 consecutive flat positions."""
    values = torch.zeros(512, 64)
    g = gen(99)
    keep, to_bin = (1, lambda idx: idx % 64) if scope == "intra" else (512, lambda idx: idx // 512)
    bins = Counter()
    for _ in range(20):
        bins.update(to_bin(select_rollouts(values, keep, scope=scope, rule="max_reward", generator=g)).tolist())
    assert_uniform(bins, set(range(64)), 20 * 512)


# ── determinism ──


@PROPERTY
@given(values=value_matrices(max_rows=5, max_cols=10, max_total=40), data=st.data(), seed=st.integers(0, 2**32))
def test_same_generator_state_gives_the_same_selection(values, data, seed):
    rows, cols = values.shape
    scope = data.draw(st.sampled_from(SCOPES))
    rule = data.draw(st.sampled_from(RULES))
    keep = data.draw(st.integers(1, cols if scope == "intra" else rows * cols))
    first = select_rollouts(values, keep, scope=scope, rule=rule, generator=gen(seed))
    again = select_rollouts(values, keep, scope=scope, rule=rule, generator=gen(seed))
    assert torch.equal(first, again)
    # memory layout does not matter
    transposed = values.t().contiguous().t()
    assert torch.equal(first, select_rollouts(transposed, keep, scope=scope, rule=rule, generator=gen(seed)))
    # without a generator, torch's global generator is used
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        global_first = select_rollouts(values, keep, scope=scope, rule=rule)
        torch.manual_seed(seed)
        assert torch.equal(global_first, select_rollouts(values, keep, scope=scope, rule=rule))


def test_different_generator_states_break_ties_differently():
    values = torch.zeros(4, 16)
    picks = {tuple(select_rollouts(values, 4, scope="intra", generator=gen(s)).tolist()) for s in range(5)}
    assert len(picks) == 5


# ── shapes ──


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(
    "shape,keep,scope",
    [
        ((1, 1), 1, "intra"),
        ((1, 1), 1, "cross"),
        ((1, 7), 7, "intra"),
        ((1, 7), 1, "intra"),
        ((5, 1), 1, "intra"),
        ((5, 1), 5, "cross"),
        ((5, 1), 2, "cross"),
        ((3, 4), 12, "cross"),
        ((3, 4), 1, "cross"),
        ((3, 4), 4, "intra"),
        ((3, 4), 1, "intra"),
    ],
)
def test_odd_shapes(shape, keep, scope, rule):
    values = torch.randn(*shape, generator=gen(7))
    rows, cols = shape
    idx = select_rollouts(values, keep, scope=scope, rule=rule, generator=gen(3))
    count = rows * keep if scope == "intra" else keep
    assert_valid_indices(idx, count, rows * cols)
    if count == rows * cols:
        assert torch.equal(idx, torch.arange(rows * cols))
    if scope == "intra":
        assert all(len(kept) == keep for kept in per_row(idx, rows, cols))
    if rule == "max_reward" and scope == "cross":
        assert torch.equal(idx, values.reshape(-1).topk(keep).indices.sort().values)


def test_input_is_left_untouched_and_the_result_is_an_ordinary_tensor():
    values = torch.randn(3, 8, requires_grad=True)
    before = values.detach().clone()
    idx = select_rollouts(values, 2, scope="intra", generator=gen(0))
    assert not idx.requires_grad and not idx.is_inference()
    assert torch.equal(values.detach(), before)
    values.reshape(-1).index_select(0, idx).sum().backward()  # usable as an index under autograd
    assert int(values.grad.sum()) == 6


# ── errors ──


@pytest.mark.parametrize(
    "values,keep,kwargs,message",
    [
        (torch.tensor([[0.0, float("nan")]]), 1, {}, "NaN or inf"),
        (torch.tensor([[0.0, float("inf")]]), 1, {}, "NaN or inf"),
        (torch.tensor([[float("-inf"), 1.0]]), 1, {"scope": "intra"}, "NaN or inf"),
        (torch.zeros(2, 3), 0, {}, "keep must be in"),
        (torch.zeros(2, 3), -1, {"scope": "intra"}, "keep must be in"),
        (torch.zeros(2, 3), 4, {"scope": "intra"}, "keep must be in"),
        (torch.zeros(2, 3), 7, {"scope": "cross"}, "keep must be in"),
        (torch.zeros(6), 1, {}, "2-D"),
        (torch.zeros(1, 2, 3), 1, {}, "2-D"),
        (torch.tensor(1.0), 1, {}, "2-D"),
        (torch.zeros(0, 4), 1, {"scope": "intra"}, "non-empty"),
        (torch.zeros(2, 3, dtype=torch.int64), 1, {}, "floating-point"),
        (torch.zeros(2, 3), 1, {"scope": "global"}, "scope must be"),
        (torch.zeros(2, 3), 1, {"rule": "max_variance"}, "rule must be"),
    ],
)
def test_value_errors(values, keep, kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_rollouts(values, keep, **kwargs)


@pytest.mark.parametrize("values,keep", [([[0.0, 1.0]], 1), (torch.zeros(2, 3), 1.5), (torch.zeros(2, 3), True)])
def test_type_errors(values, keep):
    with pytest.raises(TypeError):
        select_rollouts(values, keep)


# ── the step's generator ──


def test_step_generator_is_a_pure_function_of_seed_and_step():
    draw = lambda seed, step: torch.randperm(64, generator=step_generator(seed, step))  # noqa: E731
    assert torch.equal(draw(42, 7), draw(42, 7))
    assert not torch.equal(draw(42, 7), draw(42, 8)) and not torch.equal(draw(42, 7), draw(43, 7))


def test_keyed_uniforms_are_pure_uniform_and_independent_of_the_selections_draws():
    assert keyed_uniform(42, "skip", 7, "p", 0) == keyed_uniform(42, "skip", 7, "p", 0)
    keys = [
        (seed, stream, step, f"p{i}", occurrence)
        for seed in (0, 1)
        for stream in ("skip", "audit")
        for step in range(3)
        for i in range(50)
        for occurrence in (0, 1)
    ]
    uniforms = torch.tensor([keyed_uniform(*key) for key in keys], dtype=torch.float64)
    assert len(set(uniforms.tolist())) == len(keys) and 0.0 <= uniforms.min() and uniforms.max() < 1.0
    assert abs(uniforms.mean().item() - 0.5) < 0.05
    # each stream's draws at a step against the selection's at the same (seed, step): uncorrelated
    for stream in ("skip", "audit"):
        for step in range(4):
            keyed = torch.tensor([keyed_uniform(42, stream, step, f"p{i}", 0) for i in range(400)])
            selection = torch.rand(400, generator=step_generator(42, step), dtype=torch.float64)
            assert abs(torch.corrcoef(torch.stack([keyed, selection]))[0, 1].item()) < 0.2


# ── devices ──


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("scope", SCOPES)
def test_same_generator_state_gives_the_same_selection_on_every_device(device, generator_device, scope, rule):
    # heavy ties (binary rewards) and continuous values; the CPU values give the expected selection
    values = torch.cat([torch.randint(0, 2, (6, 16), generator=gen(1)).float(), torch.randn(6, 16, generator=gen(2))])
    keep = 5 if scope == "intra" else 40
    for seed in range(5):
        expected = select_rollouts(
            values, keep, scope=scope, rule=rule, generator=torch.Generator(generator_device).manual_seed(seed)
        )
        got = select_rollouts(
            values.to(device),
            keep,
            scope=scope,
            rule=rule,
            generator=torch.Generator(generator_device).manual_seed(seed),
        )
        assert got.device == torch.device(device) if device == "cpu" else got.device.type == device
        assert torch.equal(got.cpu(), expected)


@PROPERTY
@given(values=value_matrices(max_rows=5, max_cols=10, max_total=40), data=st.data(), seed=st.integers(0, 2**32))
def test_cross_scope_torch_path_equals_the_numpy_path(values, data, seed):
    """Cross scope runs numpy on CPU and torch elsewhere: the torch ops, run here on CPU, give the same
    selection from the same generator state."""
    import d3s_openrlhf.core.selection as selection

    rule = data.draw(st.sampled_from(["max_var", "max_reward"]))
    keep = data.draw(st.integers(1, values.numel()))
    flat = values.reshape(-1)
    expected = selection._select_extremes(flat, keep, rule, gen(seed), use_numpy=True)
    got = selection._select_extremes(flat, keep, rule, gen(seed), use_numpy=False)
    assert got.dtype == expected.dtype == torch.int64
    assert torch.equal(got, expected)


@PROPERTY
@given(values=value_matrices(max_rows=5, max_cols=10, max_total=40), data=st.data(), seed=st.integers(0, 2**32))
def test_max_var_split_torch_arithmetic_equals_the_numpy_arithmetic(values, data, seed):
    """The best split runs in numpy on CPU and in torch elsewhere: the torch ops, run here on CPU, give the
    same split from the same generator state, tied optima included."""
    import d3s_openrlhf.core.selection as selection

    rows, cols = values.shape
    m = data.draw(st.integers(1, cols))
    row_sorted = values.sort(dim=1).values
    ends = row_sorted if 2 * m >= cols else torch.cat([row_sorted[:, :m], row_sorted[:, cols - m :]], dim=1)
    expected = selection._max_var_split(ends, m, gen(seed), use_numpy=True)
    got = selection._max_var_split(ends, m, gen(seed), use_numpy=False)
    assert got.dtype == expected.dtype == torch.int64
    assert torch.equal(got, expected)


def recording_draws(monkeypatch):
    """Wrap torch.randperm and torch.rand (the real functions run) with a check that every draw is made on
    the device of the generator given; returns the list of devices drawn on."""
    draws = []

    def recording(draw):
        def wrapper(*args, generator, device=None, **kwargs):
            assert torch.device(device if device is not None else "cpu") == generator.device
            out = draw(*args, generator=generator, device=device, **kwargs)
            draws.append(out.device)
            return out

        return wrapper

    monkeypatch.setattr(torch, "randperm", recording(torch.randperm))
    monkeypatch.setattr(torch, "rand", recording(torch.rand))
    return draws


def test_every_random_draw_happens_on_the_generator_device(monkeypatch):
    import d3s_openrlhf.core.selection as selection

    draws = recording_draws(monkeypatch)
    values = torch.randint(0, 2, (6, 8), generator=gen(0)).float()
    for scope, rule in itertools.product(SCOPES, RULES):
        select_rollouts(values, 3, scope=scope, rule=rule, generator=gen(0))
    # intra: a permutation per call and the split draw of max_var (4); cross: random's permutation, a
    # permutation of the tied values at each boundary (max_reward: 1, max_var: 2) and the split draw (5)
    assert len(draws) == 9
    # Values on a device that is not the generator's (meta stands in for CUDA on a machine without one: the
    # same torch path runs, only the data is absent): the draws still happen on the CPU generator.
    kept = selection._select(torch.empty(6, 8, device="meta"), 3, "intra", "max_var", gen(0))
    assert kept.device.type == "meta" and kept.shape == (18,)
    assert draws[-2:] == [torch.device("cpu")] * 2


def test_thread_setting_is_restored_and_does_not_change_the_selection():
    values = torch.randint(0, 3, (256, 256), generator=gen(0)).float()  # above torch's 32768-element grain
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(select_rollouts(values, 20000, scope="cross", generator=gen(1)))
            assert torch.get_num_threads() == threads
            with pytest.raises(ValueError):
                select_rollouts(values, 0, scope="cross")
            assert torch.get_num_threads() == threads
        assert torch.equal(results[0], results[1])
    finally:
        torch.set_num_threads(before)
