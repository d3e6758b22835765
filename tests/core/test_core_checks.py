"""The core's shared checks (``d3s_openrlhf.core.checks``): int and real tests that refuse bools (and NaN), and
invalid options carried as fields (parameter, value, requirement) as well as in the message, and checks of tensor
contents that never make the host wait for an accelerator."""

import fractions
import pickle

import numpy as np
import pytest
import torch

from d3s_openrlhf.core.checks import InvalidOptions, Problem, check_on_device, is_int, is_real


@pytest.mark.parametrize("value", [0, -3, 7, np.int64(4), np.int32(-1)])
def test_is_int_accepts_integral_numbers(value):
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, 1.0, 2.5, "3", None, np.bool_(True), torch.tensor(3)])
def test_is_int_refuses_bools_and_everything_else(value):
    assert not is_int(value)


@pytest.mark.parametrize("value", [0, 0.5, -2.0, float("inf"), np.float32(0.25), fractions.Fraction(1, 3)])
def test_is_real_accepts_real_numbers(value):
    assert is_real(value)


@pytest.mark.parametrize("value", [True, False, float("nan"), np.float64("nan"), "0.5", None, 1j])
def test_is_real_refuses_bools_nan_and_everything_else(value):
    assert not is_real(value)


def test_a_problem_reads_as_parameter_value_and_requirement():
    problem = Problem("--d3s.n_init", 0, "must be an int >= 1")
    assert str(problem) == "--d3s.n_init=0: must be an int >= 1"
    parameter, value, requirement = problem
    assert (parameter, value, requirement) == (problem.parameter, problem.value, problem.requirement)


def test_invalid_options_carry_every_problem_as_fields_and_one_line_each():
    problems = [Problem("a", 1, "must be 2"), Problem("b", "x", "must be a number")]
    error = InvalidOptions("invalid things", problems)
    assert isinstance(error, ValueError)
    assert error.problems == tuple(problems) and error.heading == "invalid things"
    assert str(error) == "invalid things:\n  a=1: must be 2\n  b='x': must be a number"
    copy = pickle.loads(pickle.dumps(error))  # as Ray sends it between processes
    assert type(copy) is InvalidOptions and copy.problems == error.problems and str(copy) == str(error)


def test_a_check_on_the_cpu_refuses_at_once():
    check_on_device(torch.tensor([1, 2]).lt(3).all(), "never raised")
    with pytest.raises(ValueError, match="ids out of range"):
        check_on_device(torch.tensor([1, 5]).lt(3).all(), "ids out of range")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_check_on_the_gpu_never_waits_for_it():
    condition = torch.arange(1000, device="cuda").lt(1000).all()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_on_device(condition, "never raised")  # an asynchronous assertion: no copy to the host
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
