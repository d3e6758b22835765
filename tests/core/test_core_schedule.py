import dataclasses
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.schedule import DownSamplingSchedule

PROPERTY = settings(max_examples=200, deadline=None)

fractions = st.floats(1e-4, 1.0) | st.sampled_from([0.05, 0.2, 1.0])


@st.composite
def schedules(draw, kinds=("linear", "cosine", "constant")):
    return DownSamplingSchedule(
        n_init=draw(st.integers(1, 128)),
        n_final=draw(st.integers(1, 128)),
        k_init=draw(fractions),
        k_final=draw(fractions),
        total_steps=draw(st.integers(1, 300)),
        kind=draw(st.sampled_from(kinds)),
    )


@PROPERTY
@given(schedules(kinds=("linear", "cosine")), st.integers(0, 1000))
def test_a_run_of_total_steps_trains_both_ends(schedule, extra):
    # a run of S = total_steps steps trains steps 0 .. S - 1: the first is the init point, the last the final one
    last = schedule.total_steps - 1
    assert schedule.at(last + extra) == (schedule.n_final, schedule.k_final)
    assert schedule.progress(last + extra) == 1.0
    if last > 0:
        assert schedule.at(0) == (schedule.n_init, schedule.k_init) and schedule.progress(0) == 0.0
        assert schedule.progress(last - 1) < 1.0


def test_a_single_step_is_the_final_point():
    schedule = DownSamplingSchedule(8, 32, 0.05, 0.2, 1)
    assert schedule.at(0) == (32, 0.2) and schedule.progress(0) == 1.0


@PROPERTY
@given(schedules(kinds=("constant",)), st.integers(0, 10_000))
def test_constant_uses_init_values(schedule, step):
    assert schedule.at(step) == (schedule.n_init, schedule.k_init)


@PROPERTY
@given(schedules(kinds=("linear", "cosine")))
def test_monotone_and_bounded_between_init_and_final(schedule):
    n_sign = 1 if schedule.n_final >= schedule.n_init else -1
    k_sign = 1 if schedule.k_final >= schedule.k_init else -1
    previous = schedule.at(0)
    for step in range(1, schedule.total_steps + 2):
        n, k = schedule.at(step)
        assert type(n) is int and type(k) is float
        assert min(schedule.n_init, schedule.n_final) <= n <= max(schedule.n_init, schedule.n_final)
        assert min(schedule.k_init, schedule.k_final) <= k <= max(schedule.k_init, schedule.k_final)
        assert n_sign * (n - previous[0]) >= 0
        assert k_sign * (k - previous[1]) >= 0
        previous = (n, k)


@PROPERTY
@given(schedules(), st.lists(st.integers(0, 400), min_size=1, max_size=5), st.integers(0, 400))
def test_resume_equality(schedule, earlier_steps, step):
    for s in earlier_steps:  # a long-running instance that has been queried before
        schedule.at(s)
    fresh = DownSamplingSchedule(**dataclasses.asdict(schedule))
    assert fresh.at(step) == schedule.at(step)
    assert fresh == schedule


@PROPERTY
@given(schedules(kinds=("linear",)), st.data())
def test_linear_matches_paper_formula(schedule, data):
    step = data.draw(st.integers(0, schedule.total_steps))
    last = schedule.total_steps - 1
    p = Fraction(min(step, last), last) if last else Fraction(1)
    exact_n = (1 - p) * schedule.n_init + p * schedule.n_final
    n, k = schedule.at(step)
    assert n == math.floor(exact_n + Fraction(1, 2))  # nearest, halves up
    p = float(p)
    assert k == pytest.approx((1 - p) * schedule.k_init + p * schedule.k_final, abs=1e-12)


@PROPERTY
@given(schedules(kinds=("cosine",)), st.data())
def test_cosine_matches_its_formula(schedule, data):
    step = data.draw(st.integers(0, schedule.total_steps))
    last = schedule.total_steps - 1
    eased = (1 - math.cos(math.pi * (min(step, last) / last if last else 1.0))) / 2
    value = (1 - eased) * schedule.n_init + eased * schedule.n_final
    n, k = schedule.at(step)
    assert abs(n - value) <= 0.5 + 1e-9
    assert k == pytest.approx((1 - eased) * schedule.k_init + eased * schedule.k_final, abs=1e-12)


def test_half_rounding_goes_up():
    assert DownSamplingSchedule(8, 9, 1.0, 1.0, 3).at(1)[0] == 9  # 8.5
    assert DownSamplingSchedule(9, 8, 1.0, 1.0, 3).at(1)[0] == 9  # 8.5 on the way down
    assert DownSamplingSchedule(8, 32, 1.0, 1.0, 49).at(1)[0] == 9  # 8.5 exactly, though 1/48 is no double
    assert DownSamplingSchedule(8, 32, 1.0, 1.0, 49).at(3)[0] == 10  # 9.5
    assert DownSamplingSchedule(8, 9, 1.0, 1.0, 3, kind="cosine").at(1)[0] == 9  # p' = 1/2
    assert DownSamplingSchedule(8, 9, 1.0, 1.0, 4, kind="cosine").at(1)[0] == 8  # p' = 1/4
    assert DownSamplingSchedule(8, 9, 1.0, 1.0, 4, kind="cosine").at(2)[0] == 9  # p' = 3/4


def test_paper_values():
    schedule = DownSamplingSchedule(8, 32, 0.05, 0.20, 101)  # steps 0 .. 100
    assert schedule.at(50) == (20, pytest.approx(0.125))
    assert schedule.at(25) == (14, pytest.approx(0.0875))
    assert schedule.at(100) == (32, 0.2)
    assert schedule.progress(25) == 0.25 and schedule.progress(100) == 1.0 and schedule.progress(500) == 1.0
    assert schedule.max_n == 32 and schedule.min_k == 0.05
    assert DownSamplingSchedule(8, 32, 0.5, 0.2, 10, kind="constant").max_n == 8
    assert DownSamplingSchedule(8, 32, 0.5, 0.2, 10, kind="constant").min_k == 0.5
    assert DownSamplingSchedule(32, 8, 0.5, 0.2, 10).max_n == 32


def test_integer_fractions_are_stored_as_floats():
    schedule = DownSamplingSchedule(4, 4, 1, 1, 3)
    assert type(schedule.k_init) is float and schedule.at(1) == (4, 1.0)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(n_init=0), "n_init"),
        (dict(n_final=-3), "n_final"),
        (dict(n_init=2.0), "n_init"),
        (dict(n_init=True), "n_init"),
        (dict(k_init=0.0), "k_init"),
        (dict(k_final=1.5), "k_final"),
        (dict(k_final=float("nan")), "k_final"),
        (dict(k_init="0.1"), "k_init"),
        (dict(total_steps=0), "total_steps"),
        (dict(total_steps=10.0), "total_steps"),
        (dict(kind="exponential"), "kind"),
    ],
)
def test_validation(kwargs, fragment):
    base = dict(n_init=8, n_final=32, k_init=0.05, k_final=0.2, total_steps=10, kind="linear")
    base.update(kwargs)
    with pytest.raises(ValueError, match=fragment):
        DownSamplingSchedule(**base)


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_rejects_bad_steps(step):
    schedule = DownSamplingSchedule(8, 32, 0.05, 0.2, 10)
    with pytest.raises(ValueError, match="step"):
        schedule.at(step)
    with pytest.raises(ValueError, match="step"):
        schedule.progress(step)


def test_frozen():
    schedule = DownSamplingSchedule(8, 32, 0.05, 0.2, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.n_init = 4
