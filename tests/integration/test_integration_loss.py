"""integration/loss.py: D3SPolicyLoss, the pg masks and the window normalisers, against OpenRLHF 0.11's real
loss pieces.

Everything here calls the real ``openrlhf.models.PolicyLoss`` / ``aggregate_loss`` (through D3SPolicyLoss's
``super().forward``) and the real ``openrlhf.utils.loss_utils`` window code; nothing is mocked.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from openrlhf.models import PolicyLoss
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.utils.loss_utils import (
    _optimizer_step_loss_norm,
    iter_grad_accum_global_norm,
)

from d3s_openrlhf.integration.host import PG_MASK_KEY
from d3s_openrlhf.integration.loss import (
    D3SPolicyLoss,
    experience_pg_mask,
    pg_mask_from_rows,
    with_pg_window_norms,
)

LOSS_CONFIGS = {
    "ppo-token": dict(policy_loss_type="ppo", token_level_loss=True),
    "ppo-seq": dict(policy_loss_type="ppo", token_level_loss=False),
    "ppo-token-dual": dict(policy_loss_type="ppo", token_level_loss=True, dual_clip=3.0),
    "ppo-seq-dual": dict(policy_loss_type="ppo", token_level_loss=False, dual_clip=3.0),
    "ppo-token-asym": dict(policy_loss_type="ppo", token_level_loss=True, clip_eps_low=0.2, clip_eps_high=0.28),
    "gspo": dict(policy_loss_type="gspo"),
}
PPO_CONFIGS = [name for name in LOSS_CONFIGS if name != "gspo"]
# train/rollout IS correction (upstream's TIS, token level, clipped): the loss is scaled by a per-token weight
TIS = dict(
    policy_loss_type="ppo",
    token_level_loss=True,
    is_correction_level="token",
    is_correction_mode="clip",
    is_correction_threshold=(0.5, 2.0),
)


def make_batch(seed, rows=6, width=7, spread=0.5):
    """Right-padded responses like OpenRLHF's: log-probs are zero on padding (Actor multiplies by the mask)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0] = width
    action_mask = torch.arange(width)[None, :] < lengths[:, None]
    old = (-torch.rand(rows, width, generator=g) * 2 - 0.1) * action_mask
    log_probs = old + spread * torch.randn(rows, width, generator=g) * action_mask
    rollout = old + 0.1 * torch.randn(rows, width, generator=g) * action_mask
    advantages = torch.randn(rows, 1, generator=g) + 0.3 * torch.randn(rows, width, generator=g)
    advantages = advantages * action_mask  # non-zero on response tokens (a.s.), zero on padding, as upstream's
    pg_mask = (torch.rand(rows, width, generator=g) < 0.5) & action_mask
    pg_mask[1] = False  # a sequence without any kept token
    pg_mask[0, 0] = True
    return SimpleNamespace(
        log_probs=log_probs, old=old, rollout=rollout, advantages=advantages, action_mask=action_mask, pg=pg_mask
    )


def run_loss(loss_fn, batch, log_probs=None, selection=None, **norms):
    """(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio, grad wrt log_probs)."""
    leaf = (batch.log_probs if log_probs is None else log_probs).detach().clone().requires_grad_(True)
    call = lambda: loss_fn(  # noqa: E731
        leaf, batch.old, batch.advantages, action_mask=batch.action_mask, rollout_log_probs=batch.rollout, **norms
    )
    if selection is None:
        out = call()
    else:
        with loss_fn.selecting(*selection):
            out = call()
    out[0].backward()
    return (*out, leaf.grad)


def window_norms(masks, dp_size=1, gas=1):
    """Upstream's optimizer-step normalisers of a window (the masks of all its micro-batches on all ranks)."""
    return _optimizer_step_loss_norm(masks, None, dp_size, gas)


def assert_same(a, b):
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert torch.equal(x, y)


# --------------------------------------------------------------------------------------------------------------
# (a) off means identical


@pytest.mark.parametrize("use_window_norms", [False, True], ids=["local-norms", "window-norms"])
@pytest.mark.parametrize("name", [*LOSS_CONFIGS, "tis"])
def test_without_selection_the_loss_is_upstream_bit_for_bit(name, use_window_norms):
    cfg = TIS if name == "tis" else LOSS_CONFIGS[name]
    batch = make_batch(1)
    norms = window_norms([batch.action_mask], dp_size=1) if use_window_norms else {}
    expected = run_loss(PolicyLoss(**cfg), batch, **norms)
    got = run_loss(D3SPolicyLoss(**cfg), batch, **norms)
    assert_same(got, expected)
    assert expected[-1].abs().sum() > 0


@pytest.mark.parametrize("name", [*LOSS_CONFIGS, "tis"])
def test_an_all_kept_mask_gives_upstreams_loss_and_gradient_bit_for_bit(name):
    cfg = TIS if name == "tis" else LOSS_CONFIGS[name]
    batch = make_batch(2)
    norms = window_norms([batch.action_mask], dp_size=2, gas=2)
    everything = torch.ones_like(batch.action_mask)  # also "kept" on padding: the loss ANDs with action_mask
    pg_norms = window_norms([everything & batch.action_mask], dp_size=2, gas=2)
    selection = (everything, pg_norms["batch_num_tokens"], pg_norms["global_batch_size"])
    expected = run_loss(PolicyLoss(**cfg), batch, **norms)
    got = run_loss(D3SPolicyLoss(**cfg), batch, selection=selection, **norms)
    assert_same(got, expected)


# --------------------------------------------------------------------------------------------------------------
# (b) gradient only on kept tokens


@pytest.mark.parametrize("name", [*PPO_CONFIGS, "tis"])
def test_ppo_gradient_is_nonzero_exactly_on_kept_tokens(name):
    cfg = TIS if name == "tis" else LOSS_CONFIGS[name]
    batch = make_batch(3, spread=0.02)  # ratios within the clip range: every kept token has a gradient
    sel = (batch.pg, torch.tensor(9.0), torch.tensor(4.0))
    grad = run_loss(D3SPolicyLoss(**cfg), batch, selection=sel)[-1]
    assert torch.equal(grad != 0, batch.pg)


@pytest.mark.parametrize("name", PPO_CONFIGS)
def test_ppo_gradient_is_zero_on_dropped_tokens_with_clipping(name):
    batch = make_batch(4, spread=1.0)
    sel = (batch.pg, torch.tensor(9.0), torch.tensor(4.0))
    loss, clip_ratio, *_, grad = run_loss(D3SPolicyLoss(**LOSS_CONFIGS[name]), batch, selection=sel)
    assert clip_ratio > 0
    assert torch.all(grad[~batch.pg] == 0)
    assert grad[batch.pg].abs().sum() > 0


def test_gspo_gradient_reaches_all_tokens_of_sequences_with_kept_tokens_only():
    # GSPO's sequence ratio is over the full response (documented): a sequence with >= 1 kept token passes
    # gradient to all its response tokens through the ratio; a sequence without kept tokens gets none.
    batch = make_batch(5, spread=0.02)
    sel = (batch.pg, torch.tensor(9.0), torch.tensor(4.0))
    grad = run_loss(D3SPolicyLoss(**LOSS_CONFIGS["gspo"]), batch, selection=sel)[-1]
    has_kept = batch.pg.any(dim=-1, keepdim=True)
    assert torch.equal(grad != 0, batch.action_mask & has_kept)


# --------------------------------------------------------------------------------------------------------------
# (c) the loss equals the formula


def reference_pg_loss(log_probs, batch, cfg, dp_size, kept_tokens, kept_seqs):
    """The D3S PG loss written out: clipped surrogate on kept tokens only, normalised by the given counts."""
    lo, hi = cfg.get("clip_eps_low", 0.2), cfg.get("clip_eps_high", 0.2)
    am, kept, adv = batch.action_mask.float(), batch.pg.float(), batch.advantages
    if cfg["policy_loss_type"] == "gspo":
        seq_log_ratio = ((log_probs - batch.old) * am).sum(-1) / am.sum(-1)
        ratio = seq_log_ratio.exp()[:, None].expand_as(log_probs)
    else:
        ratio = (log_probs - batch.old).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
    if cfg.get("dual_clip") is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg["dual_clip"] * adv), surrogate)
    per_token = -surrogate
    if cfg["policy_loss_type"] == "ppo" and cfg["token_level_loss"]:
        return dp_size * (per_token * kept).sum() / kept_tokens
    n_kept = kept.sum(-1)
    has_kept = n_kept > 0
    per_seq = (per_token * kept).sum(-1)[has_kept] / n_kept[has_kept]
    return dp_size * per_seq.sum() / kept_seqs


@pytest.mark.parametrize("name", LOSS_CONFIGS)
def test_loss_and_gradient_equal_the_reference_formula(name):
    cfg = LOSS_CONFIGS[name]
    batch = make_batch(6, spread=0.6)
    kept_tokens, kept_seqs = torch.tensor(13.0), torch.tensor(4.0)  # normalisers of a bigger window
    loss, _, _, _, _, grad = run_loss(
        D3SPolicyLoss(**cfg),
        batch,
        selection=(batch.pg, kept_tokens, kept_seqs),
        dp_size=2,
        batch_num_tokens=torch.tensor(99.0),  # upstream's full-token normalisers must not be used for PG
        global_batch_size=torch.tensor(77.0),
    )
    leaf = batch.log_probs.clone().requires_grad_(True)
    expected = reference_pg_loss(leaf, batch, cfg, 2, kept_tokens, kept_seqs)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-5, atol=1e-7)


def test_dual_clip_surrogate_is_positively_homogeneous_in_the_advantage():
    # what the sequence-level scaling relies on: l(c * A) == c * l(A) for c >= 0, on every branch of the dual clip
    loss_fn = PolicyLoss(dual_clip=3.0, token_level_loss=True)
    ones = torch.ones(1, 1, dtype=torch.bool)
    old = torch.zeros(1, 1)
    for ratio, adv in [(0.1, -2.0), (5.0, -1.0), (0.5, 1.0), (3.0, 1.0), (1.0, -0.3), (0.9, 0.7)]:
        log_probs = torch.tensor([[math.log(ratio)]])
        plain = loss_fn(log_probs, old, torch.tensor([[adv]]), action_mask=ones)[0]
        for c in (0.0, 0.37, 1.0, 2.5):
            scaled = loss_fn(log_probs, old, torch.tensor([[c * adv]]), action_mask=ones)[0]
            torch.testing.assert_close(scaled, c * plain, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------------------
# (d) invariance to data-parallel sharding and gradient accumulation


def shared_parameter_batch(seed, rows, features=5):
    """A batch whose log-probs depend on one shared parameter vector, like a model's parameters."""
    batch = make_batch(seed, rows=rows, width=6, spread=0.0)
    g = torch.Generator().manual_seed(seed + 100)
    batch.features = torch.randn(rows, 6, features, generator=g) * 0.4
    theta = torch.randn(features, generator=g)
    return batch, theta


def rows_of(batch, idx):
    return SimpleNamespace(**{k: v[idx] for k, v in vars(batch).items()})


def pg_loss_of(loss_fn, batch, theta, dp_size, pg_norm, full_norm):
    log_probs = (batch.old + batch.features @ theta) * batch.action_mask
    with loss_fn.selecting(batch.pg, pg_norm["batch_num_tokens"], pg_norm["global_batch_size"]):
        return loss_fn(
            log_probs,
            batch.old,
            batch.advantages,
            action_mask=batch.action_mask,
            dp_size=dp_size,
            batch_num_tokens=full_norm["batch_num_tokens"],
            global_batch_size=full_norm["global_batch_size"],
        )[0]


@pytest.mark.parametrize("name", ["ppo-token", "ppo-seq", "ppo-seq-dual", "gspo"])
@pytest.mark.parametrize("windows", [1, 2])
def test_two_rank_split_with_gradient_accumulation_matches_one_rank(name, windows):
    """One optimizer step over 8 sequences on one rank vs 2 ranks x 2 micro-batches x 2 sequences.

    Per window the normalisers are summed over both (fake) ranks, as the all-reduce does; each rank backpropagates
    loss / gas per micro-batch (DeepSpeed's scaling) and the ranks' gradients are averaged (DP averaging).
    """
    loss_fn, dp, gas, micro = D3SPolicyLoss(**LOSS_CONFIGS[name]), 2, 2, 2
    batch, theta0 = shared_parameter_batch(8, rows=8 * windows)
    for w in range(windows):
        window = rows_of(batch, slice(8 * w, 8 * w + 8))
        # one rank, one micro-batch
        theta = theta0.clone().requires_grad_(True)
        one = pg_loss_of(loss_fn, window, theta, 1, window_norms([window.pg]), window_norms([window.action_mask]))
        one.backward()
        expected = theta.grad
        # two ranks, gas micro-batches each
        micro_batches = [
            [rows_of(window, slice(4 * r + micro * j, 4 * r + micro * (j + 1))) for j in range(gas)] for r in range(dp)
        ]
        everyone = [mb for rank in micro_batches for mb in rank]
        pg_norm = window_norms([mb.pg for mb in everyone], dp, gas)
        full_norm = window_norms([mb.action_mask for mb in everyone], dp, gas)
        rank_grads = []
        for rank in micro_batches:
            theta = theta0.clone().requires_grad_(True)
            for mb in rank:
                (pg_loss_of(loss_fn, mb, theta, dp, pg_norm, full_norm) / gas).backward()
            rank_grads.append(theta.grad)
        torch.testing.assert_close(sum(rank_grads) / dp, expected, rtol=1e-5, atol=1e-7)
        assert expected.abs().sum() > 0


# --------------------------------------------------------------------------------------------------------------
# (f) pg masks of micro-batches and the window iterator


def test_pg_mask_rows_are_cut_or_padded_to_the_action_mask_width_and_anded_with_it():
    action_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rows = [
        torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool),  # wider; position 3 is padding -> dropped
        torch.tensor([0, 1], dtype=torch.bool),  # narrower
        torch.tensor([1, 1, 0, 1, 0], dtype=torch.bool),
    ]
    expected = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(pg_mask_from_rows(rows, action_mask), expected)
    narrow = pg_mask_from_rows(torch.stack([r[:2] for r in rows]), action_mask)  # a (B, 2) tensor of rows
    assert torch.equal(narrow, expected & (torch.arange(4) < 2))
    with pytest.raises(ValueError, match="beyond the response width"):
        pg_mask_from_rows([torch.tensor([0, 0, 0, 0, 1], dtype=torch.bool)] * 3, action_mask)
    with pytest.raises(ValueError, match="2 pg-mask rows"):
        pg_mask_from_rows(rows[:2], action_mask)


def per_row_pg_mask(rows, action_mask):
    """The per-row reference (``pg_mask_from_rows`` before issue 50: one host read per row)."""
    width = action_mask.shape[1]
    mask = torch.zeros(action_mask.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        row = row.reshape(-1)
        if row.shape[0] > width and bool(row[width:].any()):
            raise ValueError(f"pg-mask row {i} keeps tokens beyond the response width {width}")
        n = min(width, row.shape[0])
        mask[i, :n] = row[:n].bool()
    return mask & action_mask.bool()


@pytest.mark.parametrize("batch", [0, 1, 3, 7])
@pytest.mark.parametrize("width", [0, 1, 5, 13])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("seed", range(4))
def test_pg_mask_rows_equal_the_per_row_reference(batch, width, as_tensor, seed):
    """Rows of every length around the width (as a list of 1-D rows, or one (B, L) tensor; bool or 0/1 ints), empty
    batches and responses: the vectorised rebuild equals the per-row one, refusals included."""
    g = torch.Generator().manual_seed(seed * 100 + batch * 10 + width)
    action_mask = torch.rand(batch, width, generator=g) < 0.8
    if as_tensor:
        length = int(torch.randint(0, width + 3, (), generator=g))
        rows = torch.rand(batch, length, generator=g) < 0.5
        rows[:, width:] &= seed == 3  # beyond the width: kept tokens only in the refused cases
    else:
        lengths = torch.randint(0, width + 3, (batch,), generator=g).tolist()
        rows = [
            (torch.rand(n, generator=g) < 0.5).to(torch.bool if i % 2 else torch.int64) for i, n in enumerate(lengths)
        ]
        rows = [row if seed == 3 else torch.cat([row[:width], torch.zeros_like(row[width:])]) for row in rows]
    try:
        expected = per_row_pg_mask(rows, action_mask)
    except ValueError:
        with pytest.raises(ValueError, match=f"beyond the response width {width}"):
            pg_mask_from_rows(rows, action_mask)
        return
    got = pg_mask_from_rows(rows, action_mask)
    assert got.dtype == torch.bool and torch.equal(got, expected)


def micro_batch(seed, rows=2, width=5, with_mask=True, extra=2):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    action_mask = torch.arange(width)[None, :] < lengths[:, None]
    info = {}
    if with_mask:
        # rows as the replay buffer leaves them: wider than the re-padded action mask, False beyond it
        wide = torch.zeros(rows, width + extra, dtype=torch.bool)
        wide[:, :width] = (torch.rand(rows, width, generator=g) < 0.5) & action_mask
        info[PG_MASK_KEY] = list(wide.unbind(0))
    return Experience(action_mask=action_mask, info=info)


@pytest.mark.parametrize("gas", [1, 2, 3])
def test_window_iterator_yields_upstreams_normalisers_plus_the_pg_ones(gas):
    items = [micro_batch(i, with_mask=i != 3) for i in range(7)]  # 7 = not a multiple of gas 2 / 3
    strategy = SimpleNamespace(ds_device_mesh=None)
    mask_fn = lambda e: e.action_mask  # noqa: E731  (upstream's ppo_train passes this)
    upstream = list(iter_grad_accum_global_norm(iter(items), strategy, gas, mask_fn))
    wrapped = list(with_pg_window_norms(iter_grad_accum_global_norm)(iter(items), strategy, gas, mask_fn))
    assert [it for it, _ in wrapped] == [it for it, _ in upstream]
    for (_, got), (_, expected) in zip(wrapped, upstream):
        assert got.keys() == expected.keys()
        assert got["dp_size"] == expected["dp_size"]
        assert torch.equal(got["batch_num_tokens"], expected["batch_num_tokens"])
        assert torch.equal(got["global_batch_size"], expected["global_batch_size"])
    for start in range(0, len(items), gas):
        window = items[start : start + gas]
        kept = [experience_pg_mask(it) for it in window]
        tokens = sum(int(k.sum()) for k in kept)
        seqs = sum(int(k.any(dim=-1).sum()) for k in kept)
        for it in window:
            norm = it.d3s_pg_loss_norm
            assert norm["batch_num_tokens"].item() == pytest.approx(tokens / gas)
            assert norm["global_batch_size"].item() == pytest.approx(seqs / gas)
    # item 3 has no pg mask: it counts its whole action mask
    assert torch.equal(experience_pg_mask(items[3]), items[3].action_mask)


# --------------------------------------------------------------------------------------------------------------
# D3SPolicyLoss contract


def test_selection_is_scoped_and_validated():
    batch = make_batch(9)
    loss_fn = D3SPolicyLoss()
    with pytest.raises(ValueError, match="both kept-token normalisers"):
        with loss_fn.selecting(batch.pg, None, torch.tensor(1.0)):
            pass
    with pytest.raises(ValueError, match="does not match action_mask"):
        with loss_fn.selecting(batch.pg[:, :3], torch.tensor(1.0), torch.tensor(1.0)):
            loss_fn(batch.log_probs, batch.old, batch.advantages, action_mask=batch.action_mask)
    assert loss_fn.selection is None
    with loss_fn.selecting(batch.pg, torch.tensor(1.0), torch.tensor(1.0)):
        assert loss_fn.selection[0] is batch.pg
    assert loss_fn.selection is None
