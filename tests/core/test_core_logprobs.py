import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.logprobs import chunked_logprobs_entropy, default_chunk_size


def naive(hidden, weight, targets, bias=None, temperature=1.0):
    """Full logits as OpenRLHF's Actor.forward forms them (lm_head in the model dtype, fp32 cast, / temperature),
    then log_softmax gathered at the targets and the plain entropy formula."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    log_probs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    return log_probs, entropy


# (forward atol, gradient rtol/atol) per dtype: bf16 gradients are rounded to bf16 like the reference's
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 2e-2), torch.float64: (1e-5, 1e-5)}
# fp64 inputs too: the logits are cast to fp32 exactly as upstream casts them, so fp32 arithmetic bounds the error


def make(shape, hidden_size, vocab, dtype, with_bias, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=generator).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5 * 3).to(dtype)
    bias = torch.randn(vocab, generator=generator).to(dtype) if with_bias else None
    targets = torch.randint(0, vocab, shape, generator=generator)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 5), (13,)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_matches_full_logits_values_and_gradients(dtype, shape, with_bias, temperature, chunk_size):
    hidden, weight, bias, targets = make(shape, 17, 53, dtype, with_bias, seed=1)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    log_probs, entropy = chunked_logprobs_entropy(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size
    )
    assert log_probs.dtype == entropy.dtype == torch.float32 and log_probs.shape == entropy.shape == shape
    assert not entropy.requires_grad
    ref_log_probs, ref_entropy = naive(hidden, weight, targets, bias, temperature)
    atol, grad_tol = TOL[dtype]
    torch.testing.assert_close(log_probs, ref_log_probs.float(), atol=atol, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy.detach().float(), atol=atol, rtol=0)
    upstream_grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((log_probs * upstream_grad).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_log_probs * upstream_grad.to(ref_log_probs.dtype)).sum(), leaves)
    for grad, ref in zip(grads, ref_grads):
        assert grad.dtype == ref.dtype
        torch.testing.assert_close(grad, ref, atol=grad_tol, rtol=grad_tol)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3), st.integers(1, 9), st.integers(1, 12), st.integers(1, 40), st.integers(1, 10),
    st.booleans(), st.floats(0.3, 2.0), st.integers(0, 2**31 - 1),
)
@example(1, 7, 1, 16, 1, False, 0.4375, 1449)  # a gradient of 0.015 from terms of |w| / T ~ 17: fp32 rounding 1.6e-5
def test_chunking_never_changes_the_result(batch, tokens, hidden_size, vocab, chunk, with_bias, temperature, seed):
    hidden, weight, bias, targets = make((batch, tokens), hidden_size, vocab, torch.float64, with_bias, seed)
    hidden.requires_grad_()
    log_probs, entropy = chunked_logprobs_entropy(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk
    )
    ref_log_probs, ref_entropy = naive(hidden, weight, targets, bias, temperature)
    torch.testing.assert_close(log_probs, ref_log_probs.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy.detach().float(), atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(log_probs.sum(), hidden)
    whole, _ = chunked_logprobs_entropy(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=batch * tokens
    )
    (whole_grad,) = torch.autograd.grad(whole.sum(), hidden)
    torch.testing.assert_close(grad, whole_grad, atol=1e-7, rtol=1e-7)  # one chunk or many: the same arithmetic
    (ref_grad,) = torch.autograd.grad(ref_log_probs.sum(), hidden)
    # d log p / d h = (w_target - sum_v p_v w_v) / T from fp32 probabilities: the rounding scales with |w| / T,
    # not with the (possibly cancelled) result
    scale = float(weight.abs().max()) / temperature
    torch.testing.assert_close(grad, ref_grad, atol=1e-5 * max(1.0, scale), rtol=1e-5)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_peak_memory_is_one_chunk_of_logits(requires_grad, peak_memory):
    """Full (N, V) fp32 logits are 2 MB here; a chunk is 32 KB. Forward (and backward) may hold a few chunks, the
    saved (N,) statistics and, for the weight gradient, an fp32 (V, H) accumulator, never the full logits."""
    tokens, hidden_size, vocab, chunk = 512, 16, 1000, 8
    hidden, weight, _, targets = make((tokens,), hidden_size, vocab, torch.float32, False, seed=3)
    hidden.requires_grad_(requires_grad)
    weight.requires_grad_(requires_grad)

    def run():
        log_probs, entropy = chunked_logprobs_entropy(hidden, weight, targets, chunk_size=chunk)
        if requires_grad:
            log_probs.sum().backward()
        return log_probs

    _, peak = peak_memory(run)
    chunk_bytes, full_bytes = chunk * vocab * 4, tokens * vocab * 4
    allowed = 8 * chunk_bytes + 4 * tokens * 4 + (3 * (hidden.numel() + weight.numel()) * 4 if requires_grad else 0)
    assert allowed < full_bytes / 2
    assert peak < allowed, f"peak {peak} bytes; a chunk is {chunk_bytes}, the full logits {full_bytes}"


def test_default_chunk_size_follows_the_budget():
    assert default_chunk_size(151_936) == 110
    assert default_chunk_size(10**12) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(targets=torch.tensor([[0, 53]])), r"\[0, 53\)"),
        (dict(targets=torch.tensor([[0, 1.0]])), "integer"),
        (dict(targets=torch.tensor([0, 1])), "shape"),
        (dict(weight=torch.randn(53, 5)), r"\(V, H\)"),
        (dict(weight=torch.randn(53, 17).double()), "must match"),
        (dict(bias=torch.randn(52)), "bias"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(hidden=torch.randn(17)), r"\(\.\.\., T, H\)"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(change, message):
    hidden, weight, bias, targets = make((1, 2), 17, 53, torch.float32, True, seed=4)
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, bias=bias, temperature=1.0, chunk_size=None)
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        chunked_logprobs_entropy(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets"), **kwargs)
