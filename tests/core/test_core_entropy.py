import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.entropy import entropy_from_logits

PROPERTY = settings(max_examples=200, deadline=None)


def naive_entropy(logits):
    """The unchunked formula (OpenRLHF's compute_entropy), on logits upcast to fp32."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# The function computes in fp32 on the exactly upcast input, so every input dtype is held to the contract's
# 1e-5 against the fp32 formula; against the fp64 formula the fp32 arithmetic itself adds a few 1e-6 at this
# logit scale.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 7), (3, 5, 11), (2, 3, 4, 13), (9, 2), (1, 1, 1)])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_matches_naive_formula(dtype, shape, chunk_size):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(shape, generator=generator) * 4).to(dtype)
    result = entropy_from_logits(logits, chunk_size=chunk_size)
    assert result.dtype == torch.float32 and result.shape == shape[:-1]
    torch.testing.assert_close(result, naive_entropy(logits), atol=1e-5, rtol=0)
    exact = logits.double()
    probs = torch.softmax(exact, -1)
    reference64 = torch.logsumexp(exact, -1) - (probs * exact).sum(-1)
    torch.testing.assert_close(result.double(), reference64, atol=2e-5, rtol=0)


@PROPERTY
@given(
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(1, 40),
    st.integers(1, 50),
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
)
def test_chunking_never_changes_the_result(batch, tokens, vocab, chunk_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, tokens, vocab, generator=generator) * 3).to(dtype)
    chunked = entropy_from_logits(logits, chunk_size=chunk_size)
    torch.testing.assert_close(chunked, naive_entropy(logits), atol=1e-5, rtol=0)
    assert (chunked >= -1e-5).all() and (chunked <= math.log(vocab) + 1e-5).all()


def test_low_precision_input_is_computed_as_its_fp32_value():
    logits = torch.randn(4, 6, 50).bfloat16()
    assert torch.equal(entropy_from_logits(logits, chunk_size=5), entropy_from_logits(logits.float(), chunk_size=5))


def test_known_values():
    uniform = torch.zeros(2, 3, 8)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(8)))
    peaked = torch.tensor([[[0.0, -1e4, -1e4]]])
    torch.testing.assert_close(entropy_from_logits(peaked), torch.zeros(1, 1))


def test_gradient_equals_naive_gradient():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 19, generator=generator, requires_grad=True)
    upstream = torch.randn(3, 7, generator=generator)
    (grad,) = torch.autograd.grad((entropy_from_logits(logits, chunk_size=4) * upstream).sum(), logits)
    (reference,) = torch.autograd.grad((naive_entropy(logits) * upstream).sum(), logits)
    torch.testing.assert_close(grad, reference, atol=1e-6, rtol=1e-5)


def test_minus_infinity_logits_contribute_nothing():
    logits = torch.tensor([[[1.0, float("-inf"), 2.0, float("-inf")], [0.5, 0.5, float("-inf"), 0.5]]])
    expected = torch.stack([naive_entropy(torch.tensor([1.0, 2.0])), naive_entropy(torch.tensor([0.5, 0.5, 0.5]))])
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=1)[0], expected)


def test_fp64_input_and_empty_positions():
    logits = torch.randn(2, 5, 9, dtype=torch.float64)
    result = entropy_from_logits(logits)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, naive_entropy(logits), atol=1e-6, rtol=0)
    empty = entropy_from_logits(torch.randn(2, 0, 9))
    assert empty.shape == (2, 0) and empty.dtype == torch.float32


@pytest.mark.parametrize(
    "logits, chunk_size, fragment",
    [
        (torch.randn(5), 4, "shape"),
        (torch.ones(2, 3, dtype=torch.long), 4, "floating"),
        ([[0.0, 1.0]], 4, "floating"),
        (torch.randn(2, 3, 0), 4, "vocabulary"),
        (torch.randn(2, 3), 0, "chunk_size"),
        (torch.randn(2, 3), 2.5, "chunk_size"),
        (torch.randn(2, 3), True, "chunk_size"),
    ],
)
def test_rejects_bad_input(logits, chunk_size, fragment):
    with pytest.raises(ValueError, match=fragment):
        entropy_from_logits(logits, chunk_size=chunk_size)


def test_peak_memory_is_bounded_by_a_chunk_on_a_non_contiguous_view(peak_memory):
    """The experience forward's slice logits[:, :-1][:, -A:] of fp32 logits: the extra memory must be a few
    (chunk, V) temporaries, not a copy of the (B, A, V) slice (which is what flattening the view would make)."""
    batch, seq, width, vocab, chunk = 4, 97, 64, 1000, 8
    logits = torch.randn(batch, seq, vocab)
    view = logits[:, :-1][:, -width:]
    assert not view.is_contiguous()
    entropy, peak = peak_memory(entropy_from_logits, view, chunk_size=chunk)
    torch.testing.assert_close(entropy, naive_entropy(view), atol=1e-5, rtol=0)
    chunk_bytes, slice_bytes = chunk * vocab * 4, batch * width * vocab * 4
    assert peak < 8 * chunk_bytes, f"peak {peak} bytes; a chunk is {chunk_bytes}, the whole slice {slice_bytes}"
