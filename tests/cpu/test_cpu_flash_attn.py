"""The CPU flash-attention stand-in: kernels against a per-sequence float64 reference (outputs and gradients),
then transformers' ``flash_attention_2`` path and OpenRLHF's packed Actor running on it."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.cpu import patches
from d3s_openrlhf.cpu.flash_attn import flash_attn_func, flash_attn_varlen_func

PROPERTY = settings(max_examples=60, deadline=None)
# dtype -> (atol, rtol) against the float64 reference of the same (rounded) inputs
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def reference_attention(q, k, v, scale, causal):
    """One sequence, float64, loops-free but mask-explicit: q (Lq, H, D), k/v (Lk, Hkv, D) -> (Lq, H, D)."""
    len_q, heads, _ = q.shape
    len_k, heads_kv, _ = k.shape
    k = k.repeat_interleave(heads // heads_kv, dim=1)
    v = v.repeat_interleave(heads // heads_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal:  # bottom-right aligned, as flash-attn documents
        allowed = torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + (len_k - len_q)
    out = torch.zeros(len_q, heads, v.shape[-1], dtype=q.dtype)
    rows = allowed.any(dim=1)
    if rows.any():
        s = scores[:, rows].masked_fill(~allowed[rows][None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out


@st.composite
def packings(draw, same_lengths=None):
    """(q_lens, k_lens, heads, heads_kv, head_dim, causal, scale, trailing pad)."""
    n = draw(st.integers(1, 5))
    q_lens = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    same = draw(st.booleans()) if same_lengths is None else same_lengths
    k_lens = q_lens if same else draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    heads_kv = draw(st.sampled_from([1, 2]))
    heads = heads_kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
    pad = draw(st.integers(0, 3)) if same else 0
    return q_lens, k_lens, heads, heads_kv, head_dim, causal, scale, pad


def cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def check_against_reference(dtype, q_lens, k_lens, heads, heads_kv, head_dim, causal, scale, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(q_lens) + pad, sum(k_lens) + pad
    q64 = torch.randn(total_q, heads, head_dim, generator=gen, dtype=torch.float64)
    k64 = torch.randn(total_k, heads_kv, head_dim, generator=gen, dtype=torch.float64)
    v64 = torch.randn(total_k, heads_kv, head_dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(total_q, heads, head_dim, generator=gen, dtype=torch.float64)
    # the reference sees the same rounded inputs as the kernel
    inputs = [x.to(dtype).requires_grad_() for x in (q64, k64, v64)]
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]

    out = flash_attn_varlen_func(
        *inputs, cumulative(q_lens), cumulative(k_lens), max(q_lens), max(k_lens), softmax_scale=scale, causal=causal
    )
    assert out.dtype == dtype and out.shape == (total_q, heads, head_dim)
    (out.double() * weight).sum().backward()

    scale_value = 1 / math.sqrt(head_dim) if scale is None else scale
    rq, rk, rv = ref_inputs
    pieces, oq, ok = [], 0, 0
    for lq, lk in zip(q_lens, k_lens):
        pieces.append(reference_attention(rq[oq : oq + lq], rk[ok : ok + lk], rv[ok : ok + lk], scale_value, causal))
        oq, ok = oq + lq, ok + lk
    ref = torch.cat(pieces + [torch.zeros(pad, heads, head_dim, dtype=torch.float64)])
    (ref * weight).sum().backward()

    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref.detach(), atol=atol, rtol=rtol)
    for got, want in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=atol, rtol=rtol)


@PROPERTY
@given(packings(), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**31 - 1))
def test_varlen_equals_per_sequence_attention(packing, dtype, seed):
    check_against_reference(dtype, *packing, seed)


def test_one_token_sequences_and_empty_causal_rows():
    # one-token sequences; L_q > L_k under a causal mask leaves the first rows without keys: zeros, finite grads
    check_against_reference(torch.float32, [1, 1, 3, 1], [1, 1, 3, 1], 2, 1, 8, True, None, 2, seed=0)
    check_against_reference(torch.float32, [5, 1], [2, 1], 2, 2, 8, True, 0.3, 0, seed=1)


@PROPERTY
@given(
    st.integers(1, 3),
    st.integers(1, 8),
    st.integers(1, 8),
    st.booleans(),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**31 - 1),
)
def test_dense_equals_per_sequence_attention(batch, len_q, len_k, causal, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, len_q, 4, 8, generator=gen).to(dtype)
    k = torch.randn(batch, len_k, 2, 8, generator=gen).to(dtype)
    v = torch.randn(batch, len_k, 2, 8, generator=gen).to(dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    ref = torch.stack(
        [reference_attention(q[b].double(), k[b].double(), v[b].double(), 8**-0.5, causal) for b in range(batch)]
    )
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"window_size": (4, 0)}, "window_size"),
        ({"softcap": 30.0}, "softcap"),
        ({"return_attn_probs": True}, "return_attn_probs"),
    ],
)
def test_unsupported_options_are_refused(kwargs, needle):
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=needle):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True, **kwargs)
    with pytest.raises(ValueError, match=needle):
        flash_attn_func(q[None], q[None], q[None], causal=True, **kwargs)


# ── transformers and OpenRLHF on the stand-in ──


@pytest.fixture
def stand_in(monkeypatch):
    """The runtime's flash-attention adjustments (patches._patch_*), undone after the test."""
    import flash_attn
    import flash_attn.flash_attn_interface as interface
    import transformers.modeling_flash_attention_utils as fa_utils

    for module in (flash_attn, interface):
        for name in ("flash_attn_func", "flash_attn_varlen_func"):
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", fa_utils.is_flash_attn_2_available)
    entry = fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]
    monkeypatch.setitem(entry, "general_availability_check", entry["general_availability_check"])
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)  # transformers caches the loaded kernels
    patches._patch_flash_attn(flash_attn)
    patches._patch_transformers_flash_attention(fa_utils)
    yield
    fa_utils._loaded_implementation = None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_transformers_refuses_flash_attention_2_on_cpu_without_the_stand_in(tiny_llama):
    from transformers import LlamaForCausalLM

    with pytest.raises((ImportError, ValueError), match="(?i)flash"):
        LlamaForCausalLM.from_pretrained(tiny_llama, attn_implementation="flash_attention_2")


def padded_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 300, (4, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding (OpenRLHF's prompts)
    mask[1, 9:] = 0  # right padding (its responses)
    mask[2, :10] = 0  # a one-token sequence
    return ids.masked_fill(mask == 0, 0), mask


def test_llama_flash_attention_2_equals_eager_and_sdpa(stand_in, tiny_llama):
    from transformers import LlamaForCausalLM

    ids, mask = padded_batch()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    for impl in ("eager", "sdpa", "flash_attention_2"):
        model = LlamaForCausalLM.from_pretrained(tiny_llama, attn_implementation=impl, dtype=torch.float32)
        assert model.config._attn_implementation == impl
        logits[impl] = model(ids, attention_mask=mask, position_ids=position_ids).logits[mask.bool()]
    torch.testing.assert_close(logits["flash_attention_2"], logits["eager"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits["flash_attention_2"], logits["sdpa"], atol=1e-5, rtol=1e-4)

    # packed (padding-free) input, as OpenRLHF's packing builds it: one row, position ids restart per sequence
    model = LlamaForCausalLM.from_pretrained(tiny_llama, attn_implementation="flash_attention_2", dtype=torch.float32)
    packed = model(ids[mask.bool()][None], position_ids=position_ids[mask.bool()][None]).logits[0]
    torch.testing.assert_close(packed, logits["eager"], atol=1e-5, rtol=1e-4)


def test_openrlhf_actor_packing_equals_padded_path(stand_in, tiny_llama):
    from openrlhf.models import Actor

    ids, mask = padded_batch(seed=1)
    # an action is a token whose predecessor is in the sequence too (a log-prob after padding is meaningless)
    action_mask = (mask[:, -5:] * mask[:, -6:-1]).bool()
    padded = Actor(tiny_llama, attn_implementation="eager", packing_samples=False)
    packed = Actor(tiny_llama, attn_implementation="flash_attention_2", packing_samples=True)
    assert packed.model.config._attn_implementation == "flash_attention_2"
    want = padded(ids, action_mask=action_mask, attention_mask=mask)
    got = packed(ids, action_mask=action_mask, attention_mask=mask)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == (4, 5)
    # bf16 weights (OpenRLHF's default param_dtype): a few bf16 ulps of the log-probs
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)

    # the packed path's gradients flow through the stand-in
    got.sum().backward()
    grads = [p.grad for p in packed.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
