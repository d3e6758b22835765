from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.logprobs import (
    DEFAULT_CHUNK_BUDGET_BYTES,
    chunk_budget_bytes,
    chunked_logprobs_entropy,
    default_chunk_size,
)
from pass_count import block_passes  # benchmarks/ (tests/conftest.py puts it on sys.path)


def naive(hidden, weight, targets, bias=None, temperature=1.0):
    """Full logits as OpenRLHF's Actor.forward forms them (lm_head in the model dtype, fp32 cast, / temperature),
    then log_softmax gathered at the targets, and the entropy of those logits: upstream's formula evaluated in fp64
    (in fp32 its logsumexp - sum p z cancels, see test_the_entropy_is_the_exact_one_of_the_logits)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    log_probs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return log_probs, upstream_entropy(logits.double()).float()


def upstream_entropy(logits):
    """OpenRLHF's ``compute_entropy``."""
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


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
@pytest.mark.parametrize("chunk_size, vocab_block", [(1, 1), (4, 7), (None, None)])
@pytest.mark.parametrize(
    "outputs, with_entropy", [("log_probs", False), ("log_probs", True), ("both", True), ("entropy", True)]
)
def test_matches_full_logits_values_and_gradients(
    dtype, shape, with_bias, temperature, chunk_size, vocab_block, outputs, with_entropy
):
    """Values and gradients of the log-probs alone (the entropy not asked for, or asked for and unused), of the
    entropy alone and of both equal the full-logits reference."""
    hidden, weight, bias, targets = make(shape, 17, 53, dtype, with_bias, seed=1)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    log_probs, entropy = chunked_logprobs_entropy(
        hidden,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        with_entropy=with_entropy,
    )
    assert log_probs.dtype == torch.float32 and log_probs.shape == shape
    ref_log_probs, ref_entropy = naive(hidden, weight, targets, bias, temperature)
    atol, grad_tol = TOL[dtype]
    torch.testing.assert_close(log_probs, ref_log_probs.float(), atol=atol, rtol=0)
    if with_entropy:
        assert entropy.dtype == torch.float32 and entropy.shape == shape
        torch.testing.assert_close(entropy, ref_entropy.float(), atol=atol, rtol=0)
    else:
        assert entropy is None
    # a loss of the log-probs (KL, PPO), of the entropy (entropy bonus) or of both
    g = torch.Generator().manual_seed(2)
    weights = {"log_probs": (torch.randn(shape, generator=g), 0), "entropy": (0, torch.randn(shape, generator=g))}
    weights["both"] = (weights["log_probs"][0], weights["entropy"][1])
    w_lp, w_ent = weights[outputs]

    def loss(lp, ent):
        total = 0
        if outputs != "entropy":
            total = total + (lp * w_lp.to(lp.dtype)).sum()
        if outputs != "log_probs":
            total = total + (ent * w_ent.to(ent.dtype)).sum()
        return total

    grads = torch.autograd.grad(loss(log_probs, entropy), leaves)
    ref_grads = torch.autograd.grad(loss(ref_log_probs, ref_entropy), leaves)
    # the entropy's gradient sums p_v (z_v - logsumexp + H) w_v / T over the vocabulary, terms of size |z| that
    # cancel: its fp32 rounding is that of |z|, not of the result
    grad_atol = grad_tol * (10 if outputs != "log_probs" else 1)
    for grad, ref in zip(grads, ref_grads):
        assert grad.dtype == ref.dtype
        torch.testing.assert_close(grad, ref, atol=grad_atol, rtol=grad_tol)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 9),
    st.integers(1, 12),
    st.integers(1, 40),
    st.integers(1, 10),
    st.integers(1, 41),
    st.booleans(),
    st.floats(0.3, 2.0),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
# a gradient of 0.015 from terms of |w| / T ~ 17: rounding 1.6e-5
@example(1, 7, 1, 16, 1, 16, False, 0.4375, 1449, True)
def test_chunking_never_changes_the_result(
    batch, tokens, hidden_size, vocab, chunk, block, with_bias, temperature, seed, with_entropy
):
    hidden, weight, bias, targets = make((batch, tokens), hidden_size, vocab, torch.float64, with_bias, seed)
    hidden.requires_grad_()
    log_probs, entropy = chunked_logprobs_entropy(
        hidden,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        chunk_size=chunk,
        vocab_block=block,
        with_entropy=with_entropy,
    )
    ref_log_probs, ref_entropy = naive(hidden, weight, targets, bias, temperature)
    torch.testing.assert_close(log_probs, ref_log_probs.float(), atol=1e-5, rtol=0)
    if with_entropy:
        torch.testing.assert_close(entropy, ref_entropy.detach().float(), atol=1e-5, rtol=0)
    else:
        assert entropy is None
    (grad,) = torch.autograd.grad(log_probs.sum(), hidden)
    whole, _ = chunked_logprobs_entropy(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=batch * tokens, vocab_block=vocab
    )
    (whole_grad,) = torch.autograd.grad(whole.sum(), hidden)
    # one block or many: the same arithmetic up to the order of the fp32 sum over vocabulary blocks
    torch.testing.assert_close(grad, whole_grad, atol=1e-6, rtol=1e-6)
    (ref_grad,) = torch.autograd.grad(ref_log_probs.sum(), hidden)
    # d log p / d h = (w_target - sum_v p_v w_v) / T from fp32 probabilities: the rounding scales with |w| / T,
    # not with the (possibly cancelled) result
    scale = float(weight.abs().max()) / temperature
    torch.testing.assert_close(grad, ref_grad, atol=1e-5 * max(1.0, scale), rtol=1e-5)


LOG_PROB_PASSES = {
    "forward": Counter(mm=1, amax=1, add=1, exp_=1, sum=1),
    "backward": Counter(mm=3, add=1, exp_=1, mul_=1),
}
ENTROPY_PASSES = {  # the log-probs' and the entropy's
    "forward": Counter(mm=1, amax=1, add=1, exp=1, sum=2, mul_=1),
    "backward": Counter(mm=3, add=1, exp=1, addcmul=1, mul_=1),
}
CAST_PASSES = {"forward": Counter(copy_=1), "backward": Counter(copy_=1, _to_copy=1)}  # fp32 <-> a bf16 head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("loss_of", ["log_probs", "log_probs, entropy unused", "both"])
def test_the_entropy_is_computed_only_when_asked(dtype, temperature, with_bias, loss_of):
    """Passes over each block (one chunk, one vocabulary block here; ``benchmarks/pass_count.py``): without
    ``with_entropy`` the forward and the backward do the log-prob work alone; an entropy asked for but left out of
    the loss (``--actor.entropy_coef 0``: logged only) costs its forward passes and nothing in the backward. The
    bias adds one pass, its gradient's sum; the temperature none (it is folded into the shift)."""
    tokens, vocab = 16, 512  # a block of 8,192 elements; the weight (V, H) and its gradient stay below it
    hidden, weight, bias, targets = make((tokens,), 4, vocab, dtype, with_bias, seed=8)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    with_entropy = loss_of != "log_probs"
    (log_probs, entropy), forward = block_passes(
        lambda: chunked_logprobs_entropy(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            chunk_size=tokens,
            vocab_block=vocab,
            with_entropy=with_entropy,
        ),
        tokens * vocab,
    )
    assert (entropy is None) == (not with_entropy)
    loss = log_probs.sum() + (entropy.sum() if loss_of == "both" else 0)
    _, backward = block_passes(lambda: torch.autograd.grad(loss, leaves), tokens * vocab)
    cast = dtype != torch.float32
    expected_forward = (ENTROPY_PASSES if with_entropy else LOG_PROB_PASSES)["forward"] + (
        CAST_PASSES["forward"] if cast else Counter()
    )
    expected_backward = (
        (ENTROPY_PASSES if loss_of == "both" else LOG_PROB_PASSES)["backward"]
        + (CAST_PASSES["backward"] if cast else Counter())
        + (Counter(sum=1) if with_bias else Counter())
    )
    if with_bias:  # the head matmul adds it (one addmm in place of one mm, forward and backward)
        for expected in (expected_forward, expected_backward):
            expected.subtract(mm=1)
            expected.update(addmm=1)
    assert forward == expected_forward
    assert backward == expected_backward


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_peak_memory_is_one_block_of_logits(requires_grad, with_entropy, peak_memory):
    """Full (N, V) fp32 logits are 2 MB here; a forward chunk is 32 KB, a backward block (N, 40) 80 KB. Forward
    and backward may hold a few blocks, the saved (N,) statistics, the gradients (the weight's in its own dtype,
    written block by block; the hidden states' summed in fp32), never the full logits."""
    tokens, hidden_size, vocab, chunk, block = 512, 16, 1000, 8, 40
    hidden, weight, _, targets = make((tokens,), hidden_size, vocab, torch.float32, False, seed=3)
    hidden.requires_grad_(requires_grad)
    weight.requires_grad_(requires_grad)

    def run():
        log_probs, entropy = chunked_logprobs_entropy(
            hidden, weight, targets, chunk_size=chunk, vocab_block=block, with_entropy=with_entropy
        )
        if requires_grad:
            (log_probs + (entropy if with_entropy else 0)).sum().backward()
        return log_probs

    _, peak = peak_memory(run)
    full_bytes = tokens * vocab * 4
    blocks = 4 * max(chunk * vocab, tokens * block) * 4
    allowed = blocks + 8 * tokens * 4 + (3 * (hidden.numel() + weight.numel()) * 4 if requires_grad else 0)
    assert allowed < full_bytes / 2
    assert peak < allowed, f"peak {peak} bytes; blocks of {blocks}, the full logits {full_bytes}"


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_default_blocks_stay_below_upstreams_logits_at_any_size(requires_grad, tokens, with_entropy, peak_memory):
    """The automatic sizes cover at most a quarter of the positions (vocabulary): the kernel's extra peak stays
    below one copy of the full fp32 logits, which every upstream forward holds (under 4 positions: 4 rows of logits,
    2.4 MB at a 151,936 vocabulary)."""
    hidden_size, vocab = 8, 4096
    hidden, weight, _, targets = make((tokens,), hidden_size, vocab, torch.float32, False, seed=5)
    hidden.requires_grad_(requires_grad)

    def run():
        log_probs, entropy = chunked_logprobs_entropy(hidden, weight, targets, with_entropy=with_entropy)
        if requires_grad:
            (log_probs + (entropy if with_entropy else 0)).sum().backward()

    _, peak = peak_memory(run)
    gradients = hidden.numel() * 4 * 2 if requires_grad else 0
    assert peak <= max(tokens, 4) * vocab * 4 + 8 * tokens * 4 + gradients + 4096


def test_default_chunk_size_follows_the_budget():
    assert default_chunk_size(151_936) == 110
    assert default_chunk_size(10**12) == 1
    assert chunk_budget_bytes("cpu") == DEFAULT_CHUNK_BUDGET_BYTES
    assert default_chunk_size(151_936, chunk_budget_bytes("cuda")) == 441


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_real_qwen_vocabulary_with_the_default_blocks(dtype, with_entropy):
    """151,936 tokens (Qwen2.5): the default sizes (a quarter of the rows, a quarter of the vocabulary) give the
    full-logits values and gradients of a loss of the log-probs alone, or of both outputs. The fp32 reference is
    evaluated in fp64: upstream's fp32 arithmetic is itself 1.4e-4 off the exact gradient here (the kernel 3e-5)."""
    hidden, weight, _, targets = make((9,), 24, 151_936, dtype, False, seed=7)
    hidden.requires_grad_()
    weight.requires_grad_()
    log_probs, entropy = chunked_logprobs_entropy(hidden, weight, targets, temperature=0.6, with_entropy=with_entropy)
    if dtype == torch.float32:
        logits = torch.nn.functional.linear(hidden.double(), weight.double()) / 0.6
        ref_log_probs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
        ref_entropy = upstream_entropy(logits).float()
    else:
        ref_log_probs, ref_entropy = naive(hidden, weight, targets, None, 0.6)
    atol, grad_tol = TOL[dtype]
    torch.testing.assert_close(log_probs, ref_log_probs, atol=atol * 10, rtol=0)
    if with_entropy:
        torch.testing.assert_close(entropy, ref_entropy, atol=atol * 10, rtol=0)
    scale = 0.1 if with_entropy else 0.0
    grads = torch.autograd.grad((log_probs + scale * (entropy if with_entropy else 0)).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((ref_log_probs + scale * ref_entropy).sum(), (hidden, weight))
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=grad_tol * 10, rtol=grad_tol)


def test_the_entropy_is_the_exact_one_of_the_logits():
    """The kernel sums the entropy as -sum_v p_v s_v over the log-softmax s, which has no cancellation: within 1e-5
    of the fp64 value of the same fp32 logits at a 151,936 vocabulary, where upstream's fp32 formula (logsumexp -
    sum_v p_v z_v, two numbers of the logits' size) is off by about 2e-4 (this case: 4e-4 at most)."""
    hidden, weight, _, targets = make((9,), 24, 151_936, torch.float32, False, seed=7)
    _, entropy = chunked_logprobs_entropy(hidden, weight, targets, temperature=0.6, with_entropy=True)
    logits = torch.nn.functional.linear(hidden, weight).float() / 0.6
    exact = upstream_entropy(logits.double())
    assert (entropy.double() - exact).abs().max() < 1e-5
    assert (upstream_entropy(logits).double() - exact).abs().max() < 1e-3


def free_memory(monkeypatch, free_bytes):
    """torch.cuda's memory figures as a process with ``free_bytes`` free (and nothing cached) sees them."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)


def test_the_budget_is_the_same_whatever_memory_is_free(monkeypatch):
    """Actor and reference score in different processes, and runs differ: blocks sized from the free memory would
    change the matmul shapes between them (a KL not 0 at equal weights, entropies changing in their last bits)."""
    budgets = []
    for free_bytes in (1 << 30, 64 << 30):
        free_memory(monkeypatch, free_bytes)
        budgets.append(chunk_budget_bytes(torch.device("cuda")))
    assert budgets[0] == budgets[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_actor_and_reference_agree_bit_for_bit_at_equal_weights(device, dtype, monkeypatch):
    """Two processes with different free memory (the actor's and the reference's forwards) score the same tokens:
    log-probs, entropies and gradients bitwise equal, so the KL (k1 and k3, as upstream estimates it) is exactly 0.
    1,000 positions at Qwen's vocabulary: blocks sized from 1 GiB or 64 GiB free would differ in both directions."""
    hidden, weight, _, targets = make((1000,), 64, 151_936, dtype, False, seed=11)
    hidden, weight, targets = hidden.to(device), weight.to(device), targets.to(device)
    results = []
    for free_bytes in (1 << 30, 64 << 30):
        free_memory(monkeypatch, free_bytes)
        leaf = hidden.clone().requires_grad_()
        log_probs, entropy = chunked_logprobs_entropy(leaf, weight, targets, temperature=0.7, with_entropy=True)
        (grad,) = torch.autograd.grad((log_probs + 0.1 * entropy).sum(), leaf)
        results.append((log_probs.detach(), entropy.detach(), grad))
    (actor_lp, actor_entropy, actor_grad), (ref_lp, ref_entropy, ref_grad) = results
    assert torch.equal(actor_lp, ref_lp) and torch.equal(actor_entropy, ref_entropy)
    assert torch.equal(actor_grad, ref_grad)
    log_ratio = actor_lp - ref_lp
    assert torch.all(log_ratio == 0)  # k1
    assert torch.all(log_ratio.exp() - 1 - log_ratio == 0)  # k3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151_936, 1000])
def test_cuda_matches_full_logits(dtype, vocab):
    hidden, weight, bias, targets = make((2, 96), 64, vocab, dtype, False, seed=6)
    hidden, weight, targets = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(), targets.cuda()
    log_probs, entropy = chunked_logprobs_entropy(hidden, weight, targets, temperature=0.8, with_entropy=True)
    ref_log_probs, ref_entropy = naive(hidden, weight, targets, None, 0.8)
    atol, grad_tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-4, 2e-2)}[dtype]
    torch.testing.assert_close(log_probs, ref_log_probs, atol=atol, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=atol, rtol=0)
    grads = torch.autograd.grad((log_probs - 0.1 * entropy).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((ref_log_probs - 0.1 * ref_entropy).sum(), (hidden, weight))
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=grad_tol, rtol=grad_tol)


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
        (dict(vocab_block=2.5), "vocab_block"),
        (dict(hidden=torch.randn(17)), r"\(\.\.\., T, H\)"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(change, message):
    hidden, weight, bias, targets = make((1, 2), 17, 53, torch.float32, True, seed=4)
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, bias=bias, temperature=1.0)
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        chunked_logprobs_entropy(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets"), **kwargs)
