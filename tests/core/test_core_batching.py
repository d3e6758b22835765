import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.batching import (
    fixed_updates_unit,
    intra_counts,
    kept_unit,
    legal_kept_count,
    updates_per_rollout_step,
)

PROPERTY = settings(max_examples=200, deadline=None)


def test_kept_unit_rule():
    assert kept_unit(128, 1, 4, False) == 128
    assert kept_unit(6, 4, 2, False) == 24  # lcm(6, 4 * 2)
    assert kept_unit(6, 4, 2, True) == 6  # lcm(6, 2)
    assert kept_unit(4, 2, 3, True) == 12
    assert kept_unit(8, 3, 1, False) == 24


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((0, 1, 1, False), "train_batch_size"),
        ((8, 0, 1, False), "rollout_micro_batch_size"),
        ((8, 1, 0, False), "dp_size"),
        ((8.0, 1, 1, False), "train_batch_size"),
        ((8, True, 1, False), "rollout_micro_batch_size"),
        ((8, 1, 1, 1), "dynamic_batch"),
    ],
)
def test_kept_unit_rejects(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        kept_unit(*args)


@st.composite
def count_problems(draw):
    unit = draw(st.integers(1, 64))
    total = unit * draw(st.integers(1, 40))
    target = draw(st.integers(0, total))
    minimum = draw(st.integers(1, total))
    return target, total, unit, minimum


@PROPERTY
@given(count_problems())
def test_legal_kept_count_is_the_smallest_legal_multiple(problem):
    target, total, unit, minimum = problem
    count = legal_kept_count(target, total, unit, minimum)
    wanted = max(target, minimum)
    assert count % unit == 0
    assert wanted <= count <= total
    assert count - unit < wanted


@PROPERTY
@given(
    st.integers(1, 16),  # train batch size in units of the window
    st.integers(1, 4),  # rollout micro batch size
    st.integers(1, 4),  # data-parallel ranks
    st.booleans(),
    st.integers(1, 8),  # train micro batch size per rank
    st.data(),
)
def test_legal_counts_split_evenly_over_ranks_and_windows(windows, rollout_micro, dp, dynamic, train_micro, data):
    train_batch = train_micro * dp * windows  # OpenRLHF requires train.batch_size % (micro * dp) == 0
    unit = kept_unit(train_batch, rollout_micro, dp, dynamic)
    total = unit * data.draw(st.integers(1, 6))
    kept = legal_kept_count(data.draw(st.integers(0, total)), total, unit)
    assert kept % train_batch == 0  # whole optimizer-step windows, no partial accumulation
    per_rank = kept // dp
    assert per_rank * dp == kept and per_rank % train_micro == 0  # same number of training micro-batches
    if not dynamic:
        chunks = kept // rollout_micro  # experience-making chunks dealt round-robin over the ranks
        assert chunks * rollout_micro == kept
        per_rank_chunks = [len(range(rank, chunks, dp)) for rank in range(dp)]
        assert len(set(per_rank_chunks)) == 1


@PROPERTY
@given(
    st.integers(1, 8),  # U: optimizer steps of a full batch
    st.integers(1, 4),  # rollout micro batch size
    st.integers(1, 4),  # data-parallel ranks
    st.booleans(),
    st.integers(1, 8),  # train micro batch size per rank
    st.data(),
)
def test_fixed_updates_counts_split_into_the_full_batchs_updates(
    updates, rollout_micro, dp, dynamic, train_micro, data
):
    unit = kept_unit(fixed_updates_unit(updates, train_micro, dp, dynamic), rollout_micro, dp, dynamic)
    total = unit * data.draw(st.integers(1, 6))
    kept = legal_kept_count(data.draw(st.integers(0, total)), total, unit)
    batch = kept // updates
    assert batch * updates == kept  # U equal optimizer batches, whatever the kept count
    assert batch % dp == 0  # each the same number of rollouts on every rank
    if not dynamic:
        assert (batch // dp) % train_micro == 0  # of whole micro-batches: DeepSpeed's gas = batch / (micro x dp)


def test_fixed_updates_unit_and_updates_rule():
    assert updates_per_rollout_step(128, 32) == 4
    assert fixed_updates_unit(4, 8, 1, False) == 32
    assert fixed_updates_unit(4, 8, 2, True) == 8  # dynamic batching: upstream packs the micro-batches
    with pytest.raises(ValueError, match="whole number of optimizer batches"):
        updates_per_rollout_step(100, 32)
    with pytest.raises(ValueError, match="dynamic_batch"):
        fixed_updates_unit(4, 8, 1, 0)


def test_legal_kept_count_examples():
    assert legal_kept_count(40, 256, 32) == 64
    assert legal_kept_count(64, 256, 32) == 64
    assert legal_kept_count(0, 256, 32) == 32
    assert legal_kept_count(5, 256, 32, minimum=40) == 64
    assert legal_kept_count(256, 256, 32) == 256
    assert legal_kept_count(3, 12, 1) == 3


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((4, 16, 32), "larger than the total"),
        ((4, 48, 32), "not a multiple"),
        ((65, 64, 8), "cannot keep"),
        ((4, 64, 8, 80), "cannot keep"),
        ((-1, 64, 8), "target"),
        ((4, 0, 8), "total"),
        ((4, 64, 0), "unit"),
        ((4, 64, 8, 0), "minimum"),
        ((4.0, 64, 8), "target"),
        ((4, 64, True), "unit"),
    ],
)
def test_legal_kept_count_rejects(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        legal_kept_count(*args)


@PROPERTY
@given(st.integers(0, 16), st.integers(1, 50), st.data(), st.integers(0, 2**32))
def test_intra_counts_sum_and_spread(n, prompts, data, seed):
    extra = data.draw(st.integers(0, prompts))
    kept = n * prompts + extra
    counts = intra_counts(kept, n, prompts, torch.Generator().manual_seed(seed))
    assert counts.dtype == torch.long and counts.shape == (prompts,)
    assert int(counts.sum()) == kept
    assert int((counts == n + 1).sum()) == extra and int((counts == n).sum()) == prompts - extra
    again = intra_counts(kept, n, prompts, torch.Generator().manual_seed(seed))
    assert torch.equal(counts, again)


def test_intra_counts_extra_rollouts_are_spread_uniformly():
    # 3 extra among 8 prompts, 4000 draws: each prompt expects 1500; a chi-square test at a fixed seed.
    generator = torch.Generator().manual_seed(1234)
    hits = torch.zeros(8)
    draws = 4000
    for _ in range(draws):
        hits += intra_counts(8 * 2 + 3, 2, 8, generator) - 2
    expected = draws * 3 / 8
    chi2 = float(((hits - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # 0.999 quantile of chi-square with 7 degrees of freedom
    assert int(hits.sum()) == draws * 3


def test_intra_counts_leaves_the_generator_alone_without_extras():
    generator = torch.Generator().manual_seed(7)
    state = generator.get_state()
    assert intra_counts(12, 3, 4, generator).tolist() == [3, 3, 3, 3]
    assert torch.equal(generator.get_state(), state)


def test_intra_counts_global_rng_when_no_generator():
    torch.manual_seed(3)
    first = intra_counts(7, 1, 5)
    torch.manual_seed(3)
    assert torch.equal(first, intra_counts(7, 1, 5))


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((7, 2, 4), "cannot be split"),
        ((13, 2, 4), "cannot be split"),
        ((4, 1, 0), "num_prompts"),
        ((4, -1, 2), "n must"),
        ((4.0, 1, 2), "kept"),
        ((4, 1, True), "num_prompts"),
    ],
)
def test_intra_counts_rejects(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        intra_counts(*args, generator=None)


def test_intra_counts_draws_on_the_generator_device(device, monkeypatch):
    draws = []
    randperm = torch.randperm

    def recording_randperm(*args, generator, device=None, **kwargs):
        # the real randperm runs; the wrapper only checks that it draws on the generator's device
        assert torch.device(device if device is not None else "cpu") == generator.device
        draws.append(device)
        return randperm(*args, generator=generator, device=device, **kwargs)

    expected = intra_counts(8 * 2 + 3, 2, 8, torch.Generator(device).manual_seed(5))
    monkeypatch.setattr(torch, "randperm", recording_randperm)
    counts = intra_counts(8 * 2 + 3, 2, 8, torch.Generator(device).manual_seed(5))
    assert len(draws) == 1
    assert counts.device == torch.device("cpu") and torch.equal(counts, expected)
