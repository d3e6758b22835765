"""The chunked-logits forwards on CUDA against OpenRLHF's own GPU path, values and gradients: ``training_forward``
and the experience forward against ``Actor.forward``, the kernel against upstream's ``log_probs_from_logits``.
Every batch is built on the device it is compared on, so upstream takes its CUDA path: flash-attn's Triton
cross-entropy where it imports (every GPU install of OpenRLHF), else its torch fallback; the kernel test runs both.

    pytest -m cuda tests/core tests/cuda      # on a GPU machine: torch, transformers, deepspeed, openrlhf

Skipped without CUDA. Needs no Ray and no vLLM."""

import contextlib
import functools

import pytest
import torch
from actor_batches import assert_forward_equals_upstreams, load_actor, make_experience, upstream_action_entropy
from openrlhf.models import Actor
from openrlhf.models.utils import log_probs_from_logits

from d3s_openrlhf.core.logprobs import chunked_logprobs_entropy
from d3s_openrlhf.integration import training_forward as forwards
from d3s_openrlhf.integration.experience_forward import chunked_logits_log_probs
from d3s_openrlhf.integration.host import PG_MASK_KEY
from d3s_openrlhf.integration.loss import pg_mask_from_rows
from d3s_openrlhf.integration.training_forward import NonFiniteCheck, final_hidden_states, training_forward
from upstream_logprobs import torch_fallback, triton_import_error  # benchmarks/ (tests/conftest.py puts it on sys.path)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (values, gradients) tolerance per dtype: bf16 weights and activations round both sides alike
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16"])
PACKING = pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
UPSTREAM_PATHS = pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                triton_import_error() is not None,
                reason=f"needs flash-attn's Triton cross-entropy (pip install flash-attn): {triton_import_error()}",
            ),
        ),
        "torch",
    ],
)


def flash_attn_error():
    """Why flash-attn 2's CUDA kernels cannot run here, or None."""
    from transformers.utils import is_flash_attn_2_available

    return None if is_flash_attn_2_available() else "needs flash-attn 2 with its CUDA kernels (pip install flash-attn)"


def cuda_actor(model_dir, dtype, **kwargs):
    actor = load_actor(model_dir, **kwargs)
    actor.model.to("cuda", dtype)
    return actor


@DTYPES
@PACKING
def test_training_forward_equals_upstreams(model_dir, dtype, packing):
    actor = cuda_actor(model_dir, dtype, temperature=0.7, packing_samples=packing)
    e = make_experience(actor, seed=8, pg=None)
    assert e.sequences.is_cuda
    assert_forward_equals_upstreams(actor, e, training_forward, e.action_mask, TOL[dtype], TOL[dtype])


@pytest.mark.skipif(flash_attn_error() is not None, reason=str(flash_attn_error()))
def test_forwards_on_flash_attn_varlen_with_left_padded_prompts_equal_upstreams(model_dir):
    """Packed samples through flash-attn's varlen kernels, prompts of several lengths left-padded (as rollouts
    reach the trainer): the training forward (log-probs and gradients) and the experience forward (log-probs and
    entropy) against ``Actor.forward`` on the same kernels, in bf16 (flash-attn's dtypes)."""
    actor = load_actor(model_dir, temperature=0.7, packing_samples=True, attn_implementation="flash_attention_2")
    actor.model.to("cuda", torch.bfloat16)
    assert actor.model.config._attn_implementation == "flash_attention_2"
    e = make_experience(actor, seed=46, rows=5, pg=None, left_pad=True)
    assert (e.attention_mask[:, 0] == 0).any()
    tolerance = TOL[torch.bfloat16]
    expected = assert_forward_equals_upstreams(actor, e, training_forward, e.advantages, tolerance, tolerance)
    with torch.no_grad():
        log_probs, entropy = chunked_logits_log_probs(
            actor, e.sequences, e.action_mask, e.attention_mask, with_entropy=True
        )
    torch.testing.assert_close(log_probs, expected, **TOL[torch.bfloat16])
    torch.testing.assert_close(entropy, upstream_action_entropy(actor, e), **TOL[torch.bfloat16])


@DTYPES
def test_training_forward_at_the_kept_tokens_equals_upstreams_there(model_dir, dtype):
    actor = cuda_actor(model_dir, dtype, temperature=0.6)
    e = make_experience(actor, seed=9, rows=5, pg="random")
    kept = e.action_mask & (torch.arange(e.action_mask.shape[1], device="cuda") % 2 == 0)
    expected = Actor.forward(actor, e.sequences, e.action_mask, e.attention_mask)
    (expected_grad,) = torch.autograd.grad((expected * e.advantages * kept).sum(), actor.model.lm_head.weight)
    got = training_forward(
        actor, e.sequences, e.action_mask, e.attention_mask, log_prob_mask=kept, fill_log_probs=e.action_log_probs
    )
    (grad,) = torch.autograd.grad((got * e.advantages * kept).sum(), actor.model.lm_head.weight)
    torch.testing.assert_close(got[kept], expected[kept].detach(), **TOL[dtype])
    torch.testing.assert_close(got[~kept], (e.action_log_probs * e.action_mask)[~kept].float())
    torch.testing.assert_close(grad, expected_grad, **TOL[dtype])


@DTYPES
@PACKING
def test_experience_forward_equals_upstreams_log_probs_and_entropy(model_dir, dtype, packing):
    actor = cuda_actor(model_dir, dtype, temperature=0.6, packing_samples=packing)
    e = make_experience(actor, seed=41, rows=5, pg=None)
    e.action_mask[3] = False  # a rollout without action tokens (an empty response)
    with torch.no_grad():
        expected = actor(e.sequences, e.action_mask, e.attention_mask)
        log_probs, entropy = chunked_logits_log_probs(
            actor, e.sequences, e.action_mask, e.attention_mask, with_entropy=True
        )
    torch.testing.assert_close(log_probs, expected, **TOL[dtype])
    torch.testing.assert_close(entropy, upstream_action_entropy(actor, e), **TOL[dtype])


@UPSTREAM_PATHS
@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, hidden_size, vocab", [(1, 64, 151_936), (37, 96, 50_257), (1000, 128, 3001)])
def test_the_kernel_equals_upstreams_log_probs_from_logits(path, dtype, rows, hidden_size, vocab):
    """Upstream's log-probs as ``Actor.forward`` forms them (head in the model's dtype, fp32 cast, / temperature,
    ``log_probs_from_logits``), on its Triton path and its torch fallback; gradients of the hidden states and the
    head compared too."""
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, hidden_size, generator=g).to("cuda", dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5 * 3).to("cuda", dtype)
    weight.requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g).cuda()
    advantages = torch.randn(rows, generator=g).cuda()
    logits = torch.nn.functional.linear(hidden, weight).to(torch.float32).div_(0.6)
    with torch_fallback() if path == "torch" else contextlib.nullcontext():
        expected = log_probs_from_logits(logits, targets)
    expected_grads = torch.autograd.grad((expected * advantages).sum(), (hidden, weight))
    got, _ = chunked_logprobs_entropy(hidden, weight, targets, temperature=0.6)
    grads = torch.autograd.grad((got * advantages).sum(), (hidden, weight))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, **TOL[dtype])


@contextlib.contextmanager
def sync_debug_mode(mode):
    """CUDA's sync debug mode within the block ("error": a host sync raises), the previous one after it."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def allowed_to_sync(function):
    """``function`` run with host syncs allowed, inside a block where they raise."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with sync_debug_mode("default"):
            return function(*args, **kwargs)

    return run


def upstreams_body(actor, *args, **kwargs):
    """``final_hidden_states`` with syncs allowed, its hidden states cut from the graph: the body's forward and
    backward are upstream's, whatever syncs they make."""
    hidden, output = allowed_to_sync(final_hidden_states)(actor, *args, **kwargs)
    return hidden.detach().requires_grad_(), output


@DTYPES
def test_a_training_micro_batch_syncs_only_to_size_its_head_call(model_dir, dtype, monkeypatch):
    """Issue 50 item 3: from the pg-mask rows to the head weight's gradient, a training micro-batch makes no host
    sync (CUDA's sync debug mode raises on any) but two that are not ours to remove: upstream's model up to its
    head (its attention masks; its backward is left out), and the scored positions' count, which sizes the head
    call. The mask rebuilt from ragged rows, the targets' range check, the non-finite counts, the chunked kernel's
    forward and backward and the (B, A) grid all stay on the device; the counts are read after the block."""
    actor = cuda_actor(model_dir, dtype, temperature=0.7)
    e = make_experience(actor, seed=9, rows=5, pg="random")
    wide = e.info[PG_MASK_KEY]
    rows = [row[: wide.shape[1] - i % 3] for i, row in enumerate(wide)]  # rows as collated: ragged, on the GPU
    monkeypatch.setattr(forwards, "final_hidden_states", upstreams_body)
    monkeypatch.setattr(forwards, "scored_positions", allowed_to_sync(forwards.scored_positions))
    head = actor.model.lm_head

    def micro_batch():
        pg_mask = pg_mask_from_rows(rows, e.action_mask)
        check = NonFiniteCheck()
        log_probs = training_forward(
            actor,
            e.sequences,
            e.action_mask,
            e.attention_mask,
            log_prob_mask=pg_mask,
            fill_log_probs=e.action_log_probs,
            non_finite=check,
        )
        (grad,) = torch.autograd.grad((log_probs * e.advantages * pg_mask).sum(), head.weight)
        return pg_mask, log_probs, grad, check

    expected = micro_batch()  # first calls (cuBLAS handles, allocator) outside the strict block
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        pg_mask, log_probs, grad, check = micro_batch()
    check.raise_if_any()
    torch.testing.assert_close(pg_mask, wide[:, : e.action_mask.shape[1]] & e.action_mask, rtol=0, atol=0)
    torch.testing.assert_close(log_probs, expected[1])
    torch.testing.assert_close(grad, expected[2])
    assert grad.abs().sum() > 0
