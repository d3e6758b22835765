"""The D3S actor trainer and policy actor around real OpenRLHF 0.11 objects.

Real: OpenRLHF's ``Actor`` (a tiny Llama written to a temporary directory, no hub), ``ActorPPOTrainer``
(``__init__``, ``ppo_train``, ``training_step``), ``NaiveReplayBuffer`` (append/split/collate, dynamic batching),
``PolicyLoss``, ``aggregate_loss``, ``loss_utils``, ``PolicyModelActor.forward`` and
``PolicyModelActor.init_model_from_pretrained``, with a one-process gloo group for their collectives.
Stand-ins: ``MiniStrategy`` replaces DeepspeedStrategy (no DeepSpeed engine: backward scales by 1/gas like the
engine, the optimizer step is skipped so the tests can read the accumulated gradients), and the CUDA calls that
OpenRLHF makes unconditionally (``torch.cuda.current_device/synchronize/empty_cache``) are pointed at the CPU.
"""

import contextlib
import copy
import dataclasses
import datetime
import math
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace as NS

import openrlhf.trainer.ray.ppo_actor as ppo_actor
import pytest
import torch
import torch.distributed as dist
from actor_batches import (
    VOCAB,
    assert_forward_equals_upstreams,
    assert_zero3_forwards_equal_upstreams,
    load_actor,
    make_experience,
    point_cuda_at_cpu,
    record_head_inputs,
    upstream_action_entropy,
    wide_vocabulary_batch,
)
from openrlhf.models import Actor, PolicyLoss
from openrlhf.models.utils import compute_approx_kl
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
from openrlhf.utils import loss_utils

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.core.metrics import logprob_gap
from d3s_openrlhf.integration.actor import D3SActorPPOTrainer, D3SPolicyModelActor
from d3s_openrlhf.integration.engine_gap import ENGINE_GAP
from d3s_openrlhf.integration.host import PG_MASK_KEY, parse_host_args
from d3s_openrlhf.integration.lora_sync import LoRASyncActorPPOTrainer
from d3s_openrlhf.integration.loss import D3SPolicyLoss, pg_mask_from_rows
from d3s_openrlhf.integration.replay_buffer import D3SReplayBuffer

# --------------------------------------------------------------------------------------------------------------
# fixtures (model_dir, cpu_cuda: tests/integration/conftest.py)


def make_args(**overrides):
    """OpenRLHF's arguments as its own parser gives them, on this file's toy sizes; ``group__field=value``
    overrides set fields after parsing (e.g. ``actor__loss_agg_mode="seq-mean-token-sum"``)."""
    args = parse_host_args(
        [
            *("--train.batch_size", "4"),
            *("--train.micro_batch_size", "2"),
            *("--train.max_tokens_per_gpu", "16"),
            *("--rollout.batch_size", "2"),
            *("--rollout.n_samples_per_prompt", "4"),
            *("--actor.num_gpus_per_node", "1"),
            *("--actor.eps_clip_low_high", "0.2", "0.2"),  # upstream's __main__ fills it from --actor.eps_clip
            *("--actor.adam.lr", "1e-3"),
            *("--actor.lr_scheduler", "constant"),
            *("--actor.lr_warmup_ratio", "0"),
            *("--algo.kl.init_coef", "0"),
            *("--algo.kl.estimator", "k3"),
            *("--ds.attn_implementation", "eager"),
            *("--vllm.sync_backend", "gloo"),
            *("--ckpt.path", "/nonexistent-d3s-ckpt"),
            "--ckpt.disable_ds",
        ]
    )
    for key, value in overrides.items():
        group, *rest = key.split("__")
        target = getattr(args, group)
        for part in rest[:-1]:
            target = getattr(target, part)
        setattr(target, rest[-1], value)
    return args


class MiniStrategy:
    """What ActorPPOTrainer and PolicyModelActor use of DeepspeedStrategy, for one CPU process without DeepSpeed."""

    world_size = 1

    def __init__(self, args, gas=1, device_mesh=None):
        self.args = args
        self.accumulated_gradient = gas
        self.ring_attn_group = None
        self.ds_device_mesh = device_mesh
        self.prepared_cfg = None

    def is_rank_0(self):
        return True

    def print(self, *args):
        pass

    def backward(self, loss, model, optimizer):
        (loss / self.accumulated_gradient).backward()  # a DeepSpeed engine scales by 1 / gas

    def optimizer_step(self, optimizer, model, scheduler, name=None):
        pass  # keep the accumulated gradients for the test to read

    def get_grad_norm(self, model):
        return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))

    def all_reduce(self, data, op="mean"):
        return data  # one rank

    def setup_distributed(self):
        pass

    def get_ds_train_config(self):
        return None

    def get_ds_eval_config(self, offload=False):
        return None

    def prepare(self, model_and_cfg):
        model, cfg = model_and_cfg
        self.prepared_cfg = cfg
        optim = torch.optim.AdamW(model.parameters(), lr=cfg["adam"]["lr"])
        return model, optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)


def make_trainer(cls, actor, strategy, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # NaiveReplayBuffer formats f"cuda:{device}"
    optim = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    trainer = cls(
        strategy,
        actor,
        None,
        optim,
        torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0),
        micro_train_batch_size=strategy.args.train.micro_batch_size,
        dataloader_pin_memory=False,
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return trainer


def as_training_batch(experience):
    """The experience as a training micro-batch: pg rows as a list of 1-D tensors (what make_experience_batch
    produces from the replay buffer's items)."""
    batch = copy.deepcopy(experience)
    if PG_MASK_KEY in batch.info:
        batch.info[PG_MASK_KEY] = list(batch.info[PG_MASK_KEY].unbind(0))
    return batch


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def assert_grads_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def record_loss_calls(loss_fn):
    """Record, per PolicyLoss call, the selection in force and upstream's normalisers."""
    calls = []

    def hook(module, args, kwargs):
        calls.append(
            dict(
                selection=module.selection,
                action_mask=kwargs["action_mask"],
                batch_num_tokens=kwargs["batch_num_tokens"],
                global_batch_size=kwargs["global_batch_size"],
            )
        )

    loss_fn.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


# --------------------------------------------------------------------------------------------------------------
# training_step


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("pg", [None, "all"], ids=["no-mask", "all-kept-full-logits"])
def test_training_step_is_upstream_bit_for_bit_without_mask_or_with_everything_kept(model_dir, cpu_cuda, agg, pg):
    """Without a pg mask (K = 1, no --d3s.chunked_logits) D3S runs upstream's step; with a mask that keeps every
    token, upstream's forward (--d3s.full_logits) gives upstream's step bit for bit. (The forward without full
    logits equals it within float tolerance: the tests of the next section.)"""
    args = make_args(
        actor__loss_agg_mode=agg, actor__entropy_coef=0.01, algo__kl__use_loss=True, algo__kl__init_coef=0.01
    )
    args.d3s = D3SConfig(k_init=0.5, k_final=0.5, full_logits=pg == "all").to_dict()
    upstream_actor, d3s_actor = load_actor(model_dir), load_actor(model_dir)
    experience = make_experience(upstream_actor, seed=1, pg=pg)
    upstream = make_trainer(ppo_actor.ActorPPOTrainer, upstream_actor, MiniStrategy(args), cpu_cuda)
    d3s = make_trainer(D3SActorPPOTrainer, d3s_actor, MiniStrategy(args), cpu_cuda)
    upstream_batch = as_training_batch(experience)
    upstream_batch.info.pop(PG_MASK_KEY, None)  # upstream cannot log a list of rows; D3S pops it
    expected = upstream.training_step(upstream_batch, 0.1, 0)
    got = d3s.training_step(as_training_batch(experience), 0.1, 0)
    assert_grads_equal(grads(d3s_actor), grads(upstream_actor))
    for key in ("policy_loss", "kl", "entropy_loss", "ppo_clip_ratio", "ppo_kl"):
        assert torch.equal(got["metrics"][key], expected["metrics"][key]), key
    assert PG_MASK_KEY not in got["metrics"]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_masked_training_step_gradient_is_the_reference_pg_loss_plus_upstreams_kl(model_dir, cpu_cuda, agg):
    kl_ctl = 0.3
    args = make_args(actor__loss_agg_mode=agg, algo__kl__use_loss=True, algo__kl__init_coef=0.01)
    actor, reference_actor = load_actor(model_dir), load_actor(model_dir)
    experience = make_experience(actor, seed=2)
    trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args), cpu_cuda)
    trainer.training_step(as_training_batch(experience), kl_ctl, 0)

    e = experience
    am, kept = e.action_mask, pg_mask_from_rows(e.info[PG_MASK_KEY], e.action_mask)
    log_probs = reference_actor(e.sequences, am, e.attention_mask)
    ratio = (log_probs - e.action_log_probs).exp()
    per_token = -torch.minimum(ratio * e.advantages, ratio.clamp(0.8, 1.2) * e.advantages)
    if agg == "token-mean":  # one micro-batch, one rank: normalised by its kept tokens
        pg_loss = (per_token * kept).sum() / kept.sum()
    else:  # per sequence over its kept tokens, averaged over the sequences that keep any
        n_kept = kept.sum(-1)
        pg_loss = ((per_token * kept).sum(-1)[n_kept > 0] / n_kept[n_kept > 0]).mean()
    kl = compute_approx_kl(log_probs, e.base_action_log_probs, log_probs_old=e.action_log_probs, kl_estimator="k3")
    kl_loss = (kl * am).sum() / am.sum()  # upstream: full response mask, token mean
    (pg_loss + kl_ctl * kl_loss).backward()
    for got, expected in zip(grads(actor), grads(reference_actor)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "gspo"])
def test_a_window_without_kept_tokens_trains_only_the_regularisers(model_dir, cpu_cuda, agg):
    """No kept token in the optimizer-step window: the PG term is exactly 0 (not 0/0 = NaN), and the gradient is
    upstream's KL and entropy terms alone."""
    kl_ctl, entropy_coef = 0.3, 0.01
    loss = dict(actor__policy_loss_type="gspo") if agg == "gspo" else dict(actor__loss_agg_mode=agg)
    args = make_args(**loss, actor__entropy_coef=entropy_coef, algo__kl__use_loss=True, algo__kl__init_coef=0.01)
    actor, reference_actor = load_actor(model_dir), load_actor(model_dir)
    trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args, gas=2), cpu_cuda)
    e = make_experience(actor, seed=30, pg="none")  # 4 samples: one window of two micro-batches
    trainer.replay_buffer.append(e)
    calls = record_loss_calls(trainer.actor_loss_fn)
    status = trainer.ppo_train(kl_ctl)
    assert len(calls) == 2 and all(c["selection"][1].item() == 0 for c in calls)
    assert status["policy_loss"] == 0.0
    assert all(math.isfinite(v) for v in status.values() if isinstance(v, float)), status
    got = grads(actor)
    assert all(bool(torch.isfinite(g).all()) for g in got)

    # reference: upstream's KL and entropy losses (token means over the window), nothing else
    log_probs, output = reference_actor(
        e.sequences, e.action_mask, e.attention_mask, return_output=True, return_entropy=True
    )
    kl = compute_approx_kl(log_probs, e.base_action_log_probs, log_probs_old=e.action_log_probs, kl_estimator="k3")
    entropy = output.entropy[:, -e.action_mask.shape[1] :]
    (((kl_ctl * kl - entropy_coef * entropy) * e.action_mask).sum() / e.action_mask.sum()).backward()
    for g, expected in zip(got, grads(reference_actor)):
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-7)


def test_advantages_of_dropped_tokens_do_not_reach_the_gradient(model_dir, cpu_cuda):
    args = make_args()
    results = []
    for change in (None, "dropped", "kept"):
        actor = load_actor(model_dir)
        experience = make_experience(actor, seed=3)
        kept = pg_mask_from_rows(experience.info[PG_MASK_KEY], experience.action_mask)
        if change is not None:
            where = (~kept & experience.action_mask) if change == "dropped" else kept
            experience.advantages = experience.advantages + 5.0 * where
        trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args), cpu_cuda)
        trainer.training_step(as_training_batch(experience), 0.0, 0)
        results.append(grads(actor))
    assert_grads_equal(results[1], results[0])
    assert any(not torch.equal(a, b) for a, b in zip(results[2], results[0]))


def test_normalisers_without_the_pg_ones_are_refused(model_dir, cpu_cuda):
    actor = load_actor(model_dir)
    trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(make_args()), cpu_cuda)
    batch = as_training_batch(make_experience(actor, seed=4))
    norms = loss_utils.get_loss_batch_info(trainer.strategy, batch.action_mask)
    with pytest.raises(ValueError, match="kept-token normalisers"):
        trainer.training_step(batch, 0.0, 0, norms)


def test_trainer_builds_the_d3s_loss_and_buffer_and_restores_upstreams_names(model_dir, cpu_cuda):
    args = make_args(actor__dual_clip=3.0, actor__policy_loss_type="gspo", actor__eps_clip_low_high=(0.1, 0.3))
    trainer = make_trainer(D3SActorPPOTrainer, load_actor(model_dir), MiniStrategy(args), cpu_cuda)
    upstream = make_trainer(ppo_actor.ActorPPOTrainer, load_actor(model_dir), MiniStrategy(args), cpu_cuda)
    assert type(trainer.actor_loss_fn) is D3SPolicyLoss and type(trainer.replay_buffer) is D3SReplayBuffer
    public = lambda m: {k: v for k, v in vars(m).items() if not k.startswith("_")}  # noqa: E731
    assert public(trainer.actor_loss_fn) == public(upstream.actor_loss_fn)
    assert ppo_actor.PolicyLoss is PolicyLoss and ppo_actor.NaiveReplayBuffer is NaiveReplayBuffer


# --------------------------------------------------------------------------------------------------------------
# the training forward with chunked logits


def record_entropy_requests(monkeypatch):
    """Whether each call of the chunked kernel (every chunked-logits forward) asked for the entropy."""
    import d3s_openrlhf.integration.training_forward as training_forward_module

    asked, kernel = [], training_forward_module.chunked_logprobs_entropy

    def recording(*args, with_entropy=False, **kwargs):
        asked.append(with_entropy)
        return kernel(*args, with_entropy=with_entropy, **kwargs)

    monkeypatch.setattr(training_forward_module, "chunked_logprobs_entropy", recording)
    return asked


LOSSES = {
    "ppo": {},
    "ppo-dual-clip": dict(actor__dual_clip=3.0),
    "seq-mean": dict(actor__loss_agg_mode="seq-mean-token-mean"),
    "gspo": dict(actor__policy_loss_type="gspo"),
    "kl-k1": dict(algo__kl__use_loss=True, algo__kl__init_coef=0.05, algo__kl__estimator="k1"),
    "kl-k2": dict(algo__kl__use_loss=True, algo__kl__init_coef=0.05, algo__kl__estimator="k2"),
    "kl-k3": dict(algo__kl__use_loss=True, algo__kl__init_coef=0.05, algo__kl__estimator="k3"),
    "entropy": dict(actor__entropy_coef=0.01),
    "entropy-logged": dict(actor__entropy_coef=0.0),  # upstream computes and logs it, without a loss term
    "kl-entropy-gspo": dict(
        actor__policy_loss_type="gspo", actor__entropy_coef=0.01, algo__kl__use_loss=True, algo__kl__init_coef=0.05
    ),
}


def head_rows(experience, loss):
    """The positions the head scores: the kept tokens when the loss reads only those, else every action token."""
    mask = experience.action_mask
    if loss in ("ppo", "ppo-dual-clip", "seq-mean") and PG_MASK_KEY in experience.info:
        mask = pg_mask_from_rows(experience.info[PG_MASK_KEY], mask)
    return int(mask.sum())


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_training_forward_gives_the_full_logits_loss_and_gradient(model_dir, cpu_cuda, packing, temperature, loss):
    results = []
    entropy_asked = record_entropy_requests(cpu_cuda)
    for full_logits in (True, False):
        args = make_args(**LOSSES[loss])
        args.d3s = D3SConfig(k_init=0.5, k_final=0.5, full_logits=full_logits).to_dict()
        actor = load_actor(model_dir, temperature=temperature, packing_samples=packing)
        experience = make_experience(actor, seed=5)
        trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args), cpu_cuda)
        heads = record_head_inputs(actor)
        status = trainer.training_step(as_training_batch(experience), 0.3, 0)
        results.append((grads(actor), status["metrics"], heads))
        assert "forward" not in vars(actor) and "forward" not in vars(actor.model.lm_head)  # upstream's are back
    (full_grads, full_metrics, full_heads), (got_grads, got_metrics, got_heads) = results
    assert set(got_metrics) == set(full_metrics)
    # ppo_kl and ppo_clip_ratio count the tokens whose log-prob was not computed (kept-only losses) as unchanged
    every_token = head_rows(experience, loss) == int(experience.action_mask.sum())
    for key in ("policy_loss", "kl", "entropy_loss") + (("ppo_kl", "ppo_clip_ratio") if every_token else ()):
        if key in full_metrics:
            torch.testing.assert_close(got_metrics[key], full_metrics[key], rtol=1e-5, atol=1e-6, msg=key)
    for got, expected in zip(got_grads, full_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in got_grads)
    # upstream's forward applies the head at every position; this one once, at the positions the loss reads
    assert full_heads[0][-2] == (int(experience.attention_mask.sum()) if packing else experience.sequences.shape[1])
    assert got_heads == [(head_rows(experience, loss), 64)]
    assert entropy_asked == ["entropy" in loss]  # computed only for an entropy term (or its log)


@pytest.mark.parametrize("loss", ["ppo", "kl-entropy-gspo"])
def test_chunked_logits_flag_takes_the_forward_at_every_step(model_dir, cpu_cuda, loss):
    """--d3s.chunked_logits: at a step without token selection (no pg mask: K = 1, PODS) the training forward
    too computes the log-probs of every action token with chunked logits, and equals upstream's step."""
    results = []
    for config in (None, D3SConfig(chunked_logits=True)):
        args = make_args(**LOSSES[loss])
        if config is not None:
            args.d3s = config.to_dict()
        actor = load_actor(model_dir, temperature=0.8)
        experience = make_experience(actor, seed=6, pg=None)
        trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args), cpu_cuda)
        heads = record_head_inputs(actor)
        status = trainer.training_step(as_training_batch(experience), 0.3, 0)
        results.append((grads(actor), status["metrics"]["policy_loss"], heads))
    (upstream_grads, upstream_loss, upstream_heads), (got_grads, got_loss, got_heads) = results
    assert upstream_heads[0][-2] == experience.sequences.shape[1]
    assert got_heads == [(int(experience.action_mask.sum()), 64)]
    torch.testing.assert_close(got_loss, upstream_loss, rtol=1e-5, atol=1e-6)
    for got, expected in zip(got_grads, upstream_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_a_non_finite_log_prob_stops_the_training_step_after_it(model_dir, cpu_cuda):
    """Issue 50 item 3: the training step's forward no longer waits for its finite check; the trainer reads the
    counts once the step is done (upstream's step ends with a host read) and refuses the step, naming the source."""
    args = make_args()
    args.d3s = D3SConfig(chunked_logits=True).to_dict()
    actor = load_actor(model_dir, temperature=0.8)
    experience = make_experience(actor, seed=6, pg=None)
    trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args), cpu_cuda)
    with torch.no_grad():
        actor.model.lm_head.weight[7, 0] = float("nan")
    message = "the LM head's parameters hold non-finite values.*no update made from them leaves the actor"
    with pytest.raises(FloatingPointError, match=message):
        trainer.training_step(as_training_batch(experience), 0.3, 0)


def test_training_forward_validates_its_masks(model_dir, cpu_cuda):
    from d3s_openrlhf.integration.training_forward import training_forward

    actor = load_actor(model_dir)
    e = make_experience(actor, seed=7)
    kept = pg_mask_from_rows(e.info[PG_MASK_KEY], e.action_mask)
    with pytest.raises(ValueError, match="fill_log_probs"):
        training_forward(actor, e.sequences, e.action_mask, e.attention_mask, log_prob_mask=kept)
    with pytest.raises(ValueError, match="entropy"):
        training_forward(
            actor,
            e.sequences,
            e.action_mask,
            e.attention_mask,
            log_prob_mask=kept,
            fill_log_probs=e.action_log_probs,
            return_output=True,
            return_entropy=True,
        )
    log_probs, output = training_forward(
        actor, e.sequences, e.action_mask, e.attention_mask, return_output=True, return_entropy=True
    )
    assert output.logits.shape == (e.sequences.shape[0], 0, VOCAB)
    assert output.entropy.shape == (e.sequences.shape[0], e.sequences.shape[1] - 1)
    assert torch.all(output.entropy[:, : -e.action_mask.shape[1]] == 0) and torch.all(log_probs[~e.action_mask] == 0)


def test_training_forward_only_where_the_logits_are_the_heads_output(model_dir, cpu_cuda):
    from d3s_openrlhf.integration.training_forward import training_forward_blocker

    actor = load_actor(model_dir)
    for loss in LOSSES.values():  # every loss: KL, GSPO and entropy read every token, with chunked logits
        assert training_forward_blocker(make_args(**loss), actor, False) is None
    blocked = {
        "--d3s.full_logits": (make_args(), True, None),
        "ring_attn": (make_args(), False, object()),
        "--ds.deepcompile": (make_args(ds__deepcompile=True), False, None),  # its compiled graph gathers nothing
    }
    for reason, (args, full_logits, ring_group) in blocked.items():
        assert reason in training_forward_blocker(args, actor, full_logits, ring_group), reason
    head = actor.model.lm_head
    actor.model.lm_head = torch.nn.Sequential(head)  # e.g. a LoRA-wrapped head: not a plain nn.Linear
    assert "Sequential" in training_forward_blocker(make_args(), actor, False)
    actor.model.lm_head = head
    actor.model.config.model_type = "gemma2"  # logits soft-capped after the head
    assert "gemma2" in training_forward_blocker(make_args(), actor, False)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-aux-loss"])
def test_a_deepspeed_engine_starts_the_backward_once(stage, moe, one_rank_deepspeed):
    """DeepSpeed starts its backward (ZeRO's accumulation boundary, ...) from hooks on its forward's outputs, which
    a loss of log-probs computed after that forward does not reach: without hooks of its own, the chunked-logits
    forward trained with the prologue never run. With an MoE aux loss (an engine output on the loss
    path) it still runs once."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from d3s_openrlhf.integration.training_forward import training_forward

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if moe:
        model = MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=2, num_experts_per_tok=1))
        model.config.output_router_logits = True
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    actor = Actor(model)
    actor.packing_samples = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    actor.model = engine
    starts = []
    prologue = engine._backward_prologue
    engine._backward_prologue = lambda: (starts.append(1), prologue())[1]
    e = make_experience(actor, seed=9, pg=None)
    for forward in (Actor.forward, training_forward):
        log_probs, output = forward(actor, e.sequences, e.action_mask, e.attention_mask, return_output=True)
        loss = (log_probs * e.action_mask).sum() + (output.aux_loss if moe else 0)
        engine.backward(loss)
        assert len(starts) == 1, (forward.__name__, len(starts))
        starts.clear()


def test_zero3_forwards_equal_upstreams_after_an_optimizer_step(model_dir, one_rank_deepspeed):
    """Issue 50 item 5 on gloo (tests/cuda/test_cuda_zero3.py runs it over NCCL): the training and experience
    forwards of a ZeRO-3 engine, every parameter partitioned and updated once, against the plain model's upstream
    forward."""
    assert_zero3_forwards_equal_upstreams(model_dir, "cpu", dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-5, atol=1e-6))


def test_training_step_with_a_kl_loss_never_holds_the_full_logits(tmp_path, cpu_cuda, peak_memory):
    """The paper-scale scripts' loss (PPO-clip + KL loss, K < 1): the step's extra peak stays below one copy of the
    full fp32 logits (upstream's torch path holds several) with the kernel's default block sizes."""
    from d3s_openrlhf.integration.training_forward import training_forward

    actor, sequences, attention_mask, action_mask = wide_vocabulary_batch(tmp_path, rows=2)
    (rows, length), vocab = sequences.shape, actor.model.config.vocab_size
    with torch.no_grad():
        reference = actor(sequences, action_mask, attention_mask) - 0.1

    def step(forward):
        actor.zero_grad(set_to_none=True)
        log_probs = forward(actor, sequences, action_mask, attention_mask)
        kl = compute_approx_kl(log_probs, reference, kl_estimator="k3")
        (-(log_probs.exp() * action_mask).mean() + 0.01 * kl.mean()).backward()
        return log_probs.detach()

    step(Actor.forward)  # gradient buffers exist before either measurement
    step(training_forward)
    expected, upstream_peak = peak_memory(step, Actor.forward)
    got, peak = peak_memory(step, training_forward)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    full_logits_bytes = rows * length * vocab * 4
    assert upstream_peak >= 2 * full_logits_bytes  # the measurement sees upstream's logits and their gradient
    assert peak < full_logits_bytes, (peak, full_logits_bytes)


# --------------------------------------------------------------------------------------------------------------
# ppo_train: windows and dynamic batching


def fill(trainer, actor, seeds, pg="random"):
    for seed in seeds:
        trainer.replay_buffer.append(make_experience(actor, seed=seed, pg=pg))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ppo_train_gives_every_window_its_kept_token_normalisers(model_dir, cpu_cuda, agg):
    gas = 2
    args = make_args(actor__loss_agg_mode=agg)
    actor = load_actor(model_dir)
    trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args, gas=gas), cpu_cuda)
    fill(trainer, actor, seeds=(10, 11, 12))  # 12 samples, micro-batches of 2: 6 micro-batches, 3 windows
    calls = record_loss_calls(trainer.actor_loss_fn)
    trainer.ppo_train(0.0)
    assert len(calls) == 6
    assert ppo_actor.iter_grad_accum_global_norm is loss_utils.iter_grad_accum_global_norm
    for start in range(0, len(calls), gas):
        window = calls[start : start + gas]
        kept = [c["selection"][0] for c in window]
        tokens = sum(int(k.sum()) for k in kept) / gas
        seqs = sum(int(k.any(-1).sum()) for k in kept) / gas
        full_tokens = sum(int(c["action_mask"].sum()) for c in window) / gas
        for c in window:
            assert c["selection"][1].item() == pytest.approx(tokens)
            assert c["selection"][2].item() == pytest.approx(seqs)
            assert c["batch_num_tokens"].item() == pytest.approx(full_tokens)  # upstream's, untouched
    assert all(PG_MASK_KEY in item.info for item in trainer.replay_buffer.items)  # items keep their rows (epochs)


def test_ppo_train_without_masks_is_upstream_bit_for_bit_and_restores_the_iterator(model_dir, cpu_cuda):
    args = make_args()
    runs = []
    for cls in (ppo_actor.ActorPPOTrainer, D3SActorPPOTrainer):
        actor = load_actor(model_dir)
        trainer = make_trainer(cls, actor, MiniStrategy(args, gas=2), cpu_cuda)
        fill(trainer, actor, seeds=(20, 21), pg=None)
        torch.manual_seed(7)  # the DataLoader's shuffle
        status = trainer.ppo_train(0.0)
        runs.append((grads(actor), status))
    assert_grads_equal(runs[1][0], runs[0][0])
    assert runs[1][1]["policy_loss"] == runs[0][1]["policy_loss"]

    # the module-level iterator is restored even when training fails
    actor = load_actor(model_dir)
    trainer = make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args, gas=2), cpu_cuda)
    fill(trainer, actor, seeds=(22,))

    def fail(module, args, kwargs):
        raise RuntimeError("boom")

    trainer.actor_loss_fn.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.ppo_train(0.0)
    assert ppo_actor.iter_grad_accum_global_norm is loss_utils.iter_grad_accum_global_norm


def dynamic_setup(model_dir, cpu_cuda, cls, dp=1, train_batch_size=4):
    from torch.distributed.device_mesh import init_device_mesh

    # 2 prompts x 4 samples = 8 per rollout step; with train batch 4: 2 dynamic steps; max 16 tokens per
    # micro-batch (several micro-batches per step)
    args = make_args(train__dynamic_batch_enable=True, train__max_tokens_per_gpu=16, train__batch_size=train_batch_size)
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    actor = load_actor(model_dir)
    return actor, make_trainer(cls, actor, MiniStrategy(args, device_mesh=mesh), cpu_cuda)


def test_dynamic_batching_counts_kept_tokens_per_dynamic_step(model_dir, cpu_cuda):
    actor, trainer = dynamic_setup(model_dir, cpu_cuda, D3SActorPPOTrainer)
    fill(trainer, actor, seeds=(30, 31))
    calls = record_loss_calls(trainer.actor_loss_fn)
    trainer.ppo_train(0.0)
    buffer = trainer.replay_buffer
    assert len(buffer.dynamic_indices) > 2  # several micro-batches per optimizer step
    assert len(calls) == len(buffer.dynamic_indices)

    step_items, expected = [], []
    for indices, last in zip(buffer.dynamic_indices, buffer.dynamic_optimizer_step):
        step_items.append(indices)
        if last:
            kept = [
                pg_mask_from_rows([buffer.items[i].info[PG_MASK_KEY]], buffer.items[i].action_mask[None])
                for group in step_items
                for i in group
            ]
            tokens, seqs = float(sum(int(k.sum()) for k in kept)), float(sum(int(k.any()) for k in kept))
            expected.extend([(tokens, seqs)] * len(step_items))
            step_items = []
    assert list(zip(buffer.d3s_pg_batch_num_tokens, buffer.d3s_pg_global_batch_size)) == expected
    for call, (tokens, seqs), upstream_tokens in zip(calls, expected, buffer.dynamic_batch_num_tokens):
        assert call["selection"][1].item() == tokens and call["selection"][2].item() == seqs
        assert call["batch_num_tokens"].item() == upstream_tokens
        assert tokens < upstream_tokens


def test_dynamic_batching_step_without_kept_tokens_has_a_finite_loss_and_no_pg_gradient(model_dir, cpu_cuda):
    # no shuffling under dynamic batching: a step made only of zero-advantage prompts keeps no token
    actor, trainer = dynamic_setup(model_dir, cpu_cuda, D3SActorPPOTrainer)
    fill(trainer, actor, seeds=(30, 31), pg="none")
    calls = record_loss_calls(trainer.actor_loss_fn)
    status = trainer.ppo_train(0.0)
    assert calls and all(c["selection"][1].item() == 0 for c in calls)
    assert status["policy_loss"] == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in grads(actor))  # no KL or entropy term here: nothing trains


def test_dynamic_batching_without_masks_is_upstream_bit_for_bit(model_dir, cpu_cuda):
    runs = []
    for cls in (ppo_actor.ActorPPOTrainer, D3SActorPPOTrainer):
        actor, trainer = dynamic_setup(model_dir, cpu_cuda, cls)
        fill(trainer, actor, seeds=(30, 31), pg=None)
        trainer.ppo_train(0.0)
        runs.append(grads(actor))
    assert_grads_equal(runs[1], runs[0])


@pytest.mark.parametrize("cls", [D3SActorPPOTrainer, LoRASyncActorPPOTrainer])
@pytest.mark.parametrize("lora_rank", [8, 0])
def test_under_lora_ppo_train_logs_the_engines_gap_as_the_token_mean_of_the_batch(model_dir, cpu_cuda, cls, lora_rank):
    args = make_args(ds__lora__rank=lora_rank)
    args.d3s = D3SConfig().to_dict()
    actor = load_actor(model_dir)
    trainer = make_trainer(cls, actor, MiniStrategy(args, gas=2), cpu_cuda)
    e = make_experience(actor, seed=40, pg=None)  # 4 rows of unequal lengths: two micro-batches of 2
    noise = torch.randn(e.action_log_probs.shape, generator=torch.Generator().manual_seed(41))
    e.rollout_log_probs = (e.action_log_probs + 0.1 * noise) * e.action_mask
    trainer.replay_buffer.append(e)
    status = trainer.ppo_train(0.0)
    if lora_rank:
        expected = logprob_gap(e.action_log_probs, e.rollout_log_probs, e.action_mask)
        assert status[ENGINE_GAP] == pytest.approx(float(expected), rel=1e-5)
    else:
        assert ENGINE_GAP not in status


# --------------------------------------------------------------------------------------------------------------
# fixed updates (--d3s.optimizer_steps fixed_updates): a full batch's optimizer steps at every kept count

# B 3 x G 4 = 12 rollouts, train batch 4: U = 3 updates a rollout step; micro-batches of 2: kept counts in units of 6
FIXED_UPDATES_SIZES = dict(rollout__batch_size=3, rollout__n_samples_per_prompt=4, train__batch_size=4)
FIXED_UPDATES = D3SConfig.from_flags({"preset": "d3s", "n_init": 1, "n_final": 4, "optimizer_steps": "fixed_updates"})


class EngineStrategy(MiniStrategy):
    """DeepspeedStrategy's backward and optimizer step: the DeepSpeed engine's (``actor.model``) own."""

    def backward(self, loss, model, optimizer):
        model.model.backward(loss)

    def optimizer_step(self, optimizer, model, scheduler, name=None):
        model.model.step()


class WindowStrategy(MiniStrategy):
    """The reference: plain torch, one optimizer step per ``accumulated_gradient`` micro-batches."""

    def __init__(self, args, optimizer, scheduler):
        super().__init__(args)
        self.optimizer, self.scheduler, self.calls = optimizer, scheduler, 0

    def optimizer_step(self, optimizer, model, scheduler, name=None):
        self.calls += 1
        if self.calls % self.accumulated_gradient == 0:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()


def fixed_updates_trainer(model_dir, monkeypatch, stage):
    """The D3S trainer with fixed updates over a real DeepSpeed engine (ZeRO ``stage``, SGD: its steps are exact;
    the test asks for ``one_rank_deepspeed``), built with upstream's gradient accumulation of train batch 4 /
    micro-batch 2 = 2."""
    import deepspeed

    from d3s_openrlhf.integration.host import config_namespace

    args = make_args(**FIXED_UPDATES_SIZES)
    args.d3s = config_namespace(FIXED_UPDATES)
    actor = load_actor(model_dir)
    optimizer = torch.optim.SGD(actor.model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; plain torch does not
    }
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=actor.model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    actor.model = engine
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # NaiveReplayBuffer formats f"cuda:{device}"
    trainer = D3SActorPPOTrainer(
        EngineStrategy(args, gas=2),
        actor,
        None,
        optimizer,
        scheduler,
        micro_train_batch_size=2,
        dataloader_pin_memory=False,
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return actor, trainer


def window_trainer(model_dir, monkeypatch):
    """The reference: the D3S trainer with fixed batches, in plain torch, its window set per rollout step."""
    actor = load_actor(model_dir)
    optimizer = torch.optim.SGD(actor.model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    strategy = WindowStrategy(make_args(**FIXED_UPDATES_SIZES), optimizer, scheduler)
    return actor, make_trainer(D3SActorPPOTrainer, actor, strategy, monkeypatch)


def engine_parameters(engine):
    import deepspeed

    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=hasattr(parameters[0], "ds_id")):
        return [p.detach().clone() for p in parameters]


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("pg", ["random", None], ids=["token-mask", "samples-only"])
def test_fixed_updates_trains_each_kept_count_in_the_full_batchs_updates(
    model_dir, one_rank_deepspeed, cpu_cuda, stage, pg
):
    """Kept counts 6, 12, 6 of 12 (gas 1, 2, 1): 3 optimizer steps each, the same updates as plain torch stepping
    every gas micro-batches. The engine's own boundaries (its micro-step count modulo gas) would fall mid-window at
    the second step (6 micro-steps done, then windows of 2 from an odd count ... and back); DeepSpeed's accumulation
    is upstream's again after every step."""
    actor, trainer = fixed_updates_trainer(model_dir, cpu_cuda, stage)
    reference_actor, reference = window_trainer(model_dir, cpu_cuda)
    engine = actor.model
    for step, (kept, seeds) in enumerate([(6, (70,)), (12, (71, 72)), (6, (73,))]):
        experiences = [make_experience(reference_actor, seed=seed, rows=kept // len(seeds), pg=pg) for seed in seeds]
        # the optimizer batch kept / U in micro-batches, its windows counted from the step's first micro-batch
        reference.strategy.accumulated_gradient, reference.strategy.calls = kept // 3 // 2, 0
        for model, train in ((actor, trainer), (reference_actor, reference)):
            train.replay_buffer.clear()
            for experience in experiences:
                train.replay_buffer.append(copy.deepcopy(experience))
            torch.manual_seed(step)  # the DataLoader's shuffle
            status = train.ppo_train(0.0)
            if train is trainer:
                assert status["d3s/optimizer_steps"] == 3, (step, kept)
                assert engine.gradient_accumulation_steps() == 2 and trainer.strategy.accumulated_gradient == 2
        for got, expected in zip(engine_parameters(engine), reference_actor.model.parameters()):
            torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
    assert reference.strategy.scheduler.last_epoch == 9


def test_fixed_updates_plans_the_full_batchs_dynamic_steps(model_dir, cpu_cuda):
    from d3s_openrlhf.integration.host import config_namespace

    # 2 prompts x 4 = 8 rollouts, train batch 4: U = 2 dynamic optimizer steps of kept / 2 rollouts each
    actor, trainer = dynamic_setup(model_dir, cpu_cuda, D3SActorPPOTrainer)
    trainer.args.d3s = config_namespace(dataclasses.replace(FIXED_UPDATES, n_final=2))
    fill(trainer, actor, seeds=(30,))  # 4 kept: fixed batches would take 1 step
    trainer.ppo_train(0.0)
    assert sum(trainer.replay_buffer.dynamic_optimizer_step) == 2
    assert trainer.args.train.batch_size == 4  # upstream's, after the step


# --------------------------------------------------------------------------------------------------------------
# two real data-parallel ranks (gloo) against one: the kept-token normalisers are all-reduced


TWO_RANK_SEEDS = (60, 61)  # rank r trains the 4 samples of make_experience(seed=TWO_RANK_SEEDS[r])
TWO_RANK_TIMEOUT = datetime.timedelta(minutes=5)  # a collective that waits longer raises (torch's default: 30)


def one_window_trainer(model_dir, monkeypatch, mode, dp):
    """8 samples per optimizer step over dp ranks: micro-batches of 2 and gas = 8 / (2 dp), or dynamic batching
    with a train batch of 8 (one dynamic step). One window: the DataLoader's shuffle cannot change the result."""
    if mode == "dynamic":
        return dynamic_setup(model_dir, monkeypatch, D3SActorPPOTrainer, dp=dp, train_batch_size=8)
    args = make_args(train__batch_size=8)
    actor = load_actor(model_dir)
    return actor, make_trainer(D3SActorPPOTrainer, actor, MiniStrategy(args, gas=8 // (2 * dp)), monkeypatch)


def two_rank_worker(rank, store, model_dir, out):
    """One of two gloo ranks (run as a subprocess of the test): trains its half, averages the gradients over the
    ranks as DeepSpeed does, rank 0 saves them. The ranks meet in a file store: a TCP port handed to the first rank
    could be taken before it binds it, and the other rank would wait for it for torch's 30 minutes."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=TWO_RANK_TIMEOUT)
    monkeypatch = point_cuda_at_cpu(pytest.MonkeyPatch())
    results = {}
    for mode in ("window", "dynamic"):
        actor, trainer = one_window_trainer(model_dir, monkeypatch, mode, dp=2)
        fill(trainer, actor, seeds=(TWO_RANK_SEEDS[rank],))
        trainer.ppo_train(0.0)
        results[mode] = grads(actor)
        for g in results[mode]:
            dist.all_reduce(g)
            g /= 2
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # neither rank leaves while the other still talks to it
    dist.destroy_process_group()


def run_ranks(commands, logs, deadline_s):
    """Run the ranks' commands (one thread each, output to the files ``logs``) to the end; a rank that fails, or
    the deadline, stops the others. Returns each rank's exit code."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with contextlib.ExitStack() as files:
        outs = [files.enter_context(open(log, "w")) for log in logs]
        workers = [subprocess.Popen(c, env=env, stdout=o, stderr=subprocess.STDOUT) for c, o in zip(commands, outs)]
        end = time.monotonic() + deadline_s
        while any(w.poll() is None for w in workers):
            if time.monotonic() > end or any(w.returncode not in (None, 0) for w in workers):
                for w in workers:
                    w.kill()
            time.sleep(0.5)
    return [w.returncode for w in workers]


def test_a_rank_that_fails_stops_the_other_at_once(tmp_path):
    """A rank that dies (CI of 2026-11-28: rank 0 gone, rank 1 waiting for its store) ends the test with
    both ranks' output, not at the deadline."""
    commands = [[sys.executable, "-c", "raise SystemExit(3)"], [sys.executable, "-c", "import time; time.sleep(600)"]]
    start = time.monotonic()
    assert run_ranks(commands, [tmp_path / "0.log", tmp_path / "1.log"], deadline_s=600) == [3, -9]
    assert time.monotonic() - start < 60


def test_two_gloo_ranks_give_the_gradient_of_one_rank_with_both_halves(model_dir, cpu_cuda, tmp_path):
    out, store, logs = tmp_path / "grads.pt", tmp_path / "store", [tmp_path / f"rank{r}.log" for r in (0, 1)]
    commands = [[sys.executable, __file__, str(rank), str(store), model_dir, str(out)] for rank in (0, 1)]
    codes = run_ranks(commands, logs, deadline_s=600)
    assert codes == [0, 0], "\n".join(
        f"rank {r} (exit {c}):\n{logs[r].read_text()[-3000:]}" for r, c in enumerate(codes)
    )
    two_ranks = torch.load(out)
    for mode in ("window", "dynamic"):
        actor, trainer = one_window_trainer(model_dir, cpu_cuda, mode, dp=1)
        fill(trainer, actor, seeds=TWO_RANK_SEEDS)
        trainer.ppo_train(0.0)
        for got, expected in zip(two_ranks[mode], grads(actor)):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------------------------
# the policy actor: entropy forward and init


def bare_policy_actor(actor, args):
    """The Ray actor's class without Ray (its __init__ only sets up distributed env vars)."""
    worker = D3SPolicyModelActor.__ray_actor_class__.__new__(D3SPolicyModelActor.__ray_actor_class__)
    worker.actor = actor
    worker.strategy = MiniStrategy(args)
    return worker


def with_full_logits(args, full_logits):
    args.d3s = D3SConfig(k_init=0.5, k_final=0.5, full_logits=full_logits).to_dict()
    return args


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("full_logits", [False, True], ids=["chunked-logits", "full-logits"])
def test_entropy_forward_returns_upstreams_log_probs_and_the_action_entropy(model_dir, cpu_cuda, packing, full_logits):
    actor = load_actor(model_dir, temperature=0.7, packing_samples=packing)
    worker = bare_policy_actor(actor, with_full_logits(make_args(), full_logits))
    e = make_experience(actor, seed=40, pg=None)
    upstream_forward = ppo_actor.PolicyModelActor.__ray_actor_class__.forward

    expected_log_probs = upstream_forward(worker, e.sequences, e.action_mask, e.attention_mask)
    assert torch.equal(worker.forward(e.sequences, e.action_mask, e.attention_mask), expected_log_probs)
    heads = record_head_inputs(actor)
    entropy_asked = record_entropy_requests(cpu_cuda)
    log_probs, entropy = worker.forward(e.sequences, e.action_mask, e.attention_mask, return_entropy=True)
    if full_logits:  # upstream's forward, bit for bit, and the entropy of its logits
        assert torch.equal(log_probs, expected_log_probs)
        assert heads[0][-2] > 0 and entropy_asked == []
    else:  # the head ran once, on the action positions only, with the entropy
        torch.testing.assert_close(log_probs, expected_log_probs, rtol=1e-5, atol=1e-6)
        assert heads == [(int(e.action_mask.sum()), 64)] and entropy_asked == [True]
    assert log_probs.device.type == "cpu" and entropy.device.type == "cpu" and entropy.shape == log_probs.shape
    assert worker.actor is actor and actor.training
    torch.testing.assert_close(entropy, upstream_action_entropy(actor, e), rtol=1e-5, atol=1e-5)
    assert torch.all(entropy[~e.action_mask] == 0) and torch.all(entropy[e.action_mask] > 0)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_training_forward_on_left_padded_prompts_equals_upstreams(model_dir, packing):
    """Prompts of several lengths, left-padded as rollouts reach the trainer: log-probs and every gradient of the
    chunked-logits training forward against ``Actor.forward`` (tests/cuda runs the same on flash-attn's varlen
    kernels)."""
    from d3s_openrlhf.integration.training_forward import training_forward

    actor = load_actor(model_dir, temperature=0.7, packing_samples=packing)
    e = make_experience(actor, seed=45, rows=5, pg=None, left_pad=True)
    assert (e.attention_mask[:, 0] == 0).any()
    values, grads = dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-4, atol=1e-6)
    assert_forward_equals_upstreams(actor, e, training_forward, e.advantages, values, grads)


@pytest.mark.parametrize("full_logits", [False, True], ids=["chunked-logits", "full-logits"])
def test_policy_forward_gives_log_probs_with_chunked_logits_when_asked(model_dir, cpu_cuda, full_logits):
    """--d3s.chunked_logits at a step without token selection: the log-probs alone, from the hidden states."""
    actor = load_actor(model_dir, temperature=0.7)
    worker = bare_policy_actor(actor, with_full_logits(make_args(), full_logits))
    e = make_experience(actor, seed=43, pg=None)
    upstream_forward = ppo_actor.PolicyModelActor.__ray_actor_class__.forward
    expected = upstream_forward(worker, e.sequences, e.action_mask, e.attention_mask)
    heads = record_head_inputs(actor)
    entropy_asked = record_entropy_requests(cpu_cuda)
    got = worker.forward(e.sequences, e.action_mask, e.attention_mask, chunked_logits=True)
    assert isinstance(got, torch.Tensor) and worker.actor is actor
    assert entropy_asked == ([] if full_logits else [False])  # the log-probs alone
    if full_logits:
        assert torch.equal(got, expected) and heads[0][-2] == e.sequences.shape[1]
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert heads == [(int(e.action_mask.sum()), 64)]


@pytest.mark.parametrize(
    "source, message",
    [
        ("body", "the final hidden states are non-finite at {count} of them: the model's own forward"),
        ("head", "the LM head's parameters hold non-finite values"),
        ("kernel", "their hidden states and the LM head are finite: the chunked kernel (core.logprobs)"),
    ],
)
@pytest.mark.parametrize("with_entropy", [False, True], ids=["log_probs", "with_entropy"])
def test_a_non_finite_log_prob_is_refused_naming_where_it_comes_from(
    model_dir, cpu_cuda, monkeypatch, source, message, with_entropy
):
    """Issue 30 item 5: whatever produced it, a NaN stops the chunked-logits forward (experience and training) with a
    message that says whether upstream's own computation (the model up to its head, or the head's weight) made it;
    the loss never sees it. Issue 50 item 3: the training step's check reads the counts where the host waits anyway
    (after the step), and says so."""
    from d3s_openrlhf.integration import training_forward
    from d3s_openrlhf.integration.experience_forward import chunked_logits_log_probs

    actor = load_actor(model_dir, temperature=0.7)
    e = make_experience(actor, seed=43, rows=3, pg=None)
    model = training_forward.causal_lm(actor)
    with torch.no_grad():
        if source == "body":
            model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        elif source == "head":
            model.lm_head.weight[7, 0] = float("nan")
    kernel = training_forward.chunked_logprobs_entropy

    def kernel_with_a_nan(*args, **kwargs):
        log_probs, entropy = kernel(*args, **kwargs)
        return log_probs.index_fill(0, torch.tensor([1]), float("nan")), entropy

    if source == "kernel":
        monkeypatch.setattr(training_forward, "chunked_logprobs_entropy", kernel_with_a_nan)
    count = 1 if source == "kernel" else int(e.action_mask.sum())  # one NaN made by the kernel, else every token
    total = int(e.action_mask.sum())
    expected = f"non-finite log-probs or entropy at {count} of {total} action tokens; {message.format(count=count)}"
    with pytest.raises(FloatingPointError, match=re.escape(expected)):
        chunked_logits_log_probs(actor, e.sequences, e.action_mask, e.attention_mask, with_entropy=with_entropy)
    with pytest.raises(FloatingPointError, match="no NaN reaches the loss"):
        training_forward.training_forward(actor, e.sequences, e.action_mask, e.attention_mask)
    # the trainer's forward waits for no check: the counts stay on the device until it reads them after the step
    check = training_forward.NonFiniteCheck(prevents="no update made from them leaves the actor")
    log_probs = training_forward.training_forward(actor, e.sequences, e.action_mask, e.attention_mask, non_finite=check)
    assert log_probs.shape == e.action_mask.shape
    with pytest.raises(FloatingPointError, match=re.escape(expected) + ".*no update made from them leaves the actor"):
        check.raise_if_any()
    check.raise_if_any()  # read once: nothing left


def bare_reference_actor(actor, args):
    from d3s_openrlhf.integration.actor import D3SReferenceModelActor

    worker = D3SReferenceModelActor.__ray_actor_class__.__new__(D3SReferenceModelActor.__ray_actor_class__)
    worker.model = actor
    worker.strategy = MiniStrategy(args)
    return worker


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_reference_chunked_logits_forward_when_asked(model_dir, cpu_cuda, packing):
    import openrlhf.trainer.ray.launcher as launcher

    entropy_asked = record_entropy_requests(cpu_cuda)
    actor = load_actor(model_dir, temperature=0.8, packing_samples=packing)
    actor.eval()
    e = make_experience(actor, seed=42, pg=None)
    upstream = launcher.ReferenceModelActor.__ray_actor_class__.forward
    for full_logits in (False, True):
        worker = bare_reference_actor(actor, with_full_logits(make_args(), full_logits))
        expected = upstream(worker, e.sequences, e.action_mask, e.attention_mask)
        assert torch.equal(worker.forward(e.sequences, e.action_mask, e.attention_mask), expected)
        heads = record_head_inputs(actor)
        got = worker.forward(e.sequences, e.action_mask, e.attention_mask, chunked_logits=True)
        assert worker.model is actor and got.device.type == "cpu"
        if full_logits:
            assert torch.equal(got, expected) and heads[0][-2] > 0
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            assert heads == [(int(e.action_mask.sum()), 64)]
        actor.model.get_output_embeddings()._forward_hooks.clear()
    assert entropy_asked == [False]  # the reference's log-probs alone, never its entropy


def test_the_model_actors_step_aside_for_upstreams_forward_under_deepcompile():
    from d3s_openrlhf.integration.actor import _chunked_logits_blocker

    strategy = NS(args=make_args(ds__deepcompile=True), ring_attn_group=None)
    assert "--ds.deepcompile" in _chunked_logits_blocker(strategy, model=None)  # decided before the model is read


def test_init_model_swaps_the_trainer_and_keeps_the_given_lr_horizon(model_dir, cpu_cuda):
    cfg = D3SConfig.from_flags({"preset": "d3s", "n_init": 1, "n_final": 3})
    args = make_args(rollout__batch_size=2, rollout__n_samples_per_prompt=4, train__batch_size=2)
    args.d3s = cfg.to_dict()
    max_steps = 7  # the D3S trainers' get_max_steps already counts the kept rollouts only

    cpu_cuda.setattr(torch.cuda, "current_device", lambda: 0)  # NaiveReplayBuffer formats f"cuda:{device}"
    worker = D3SPolicyModelActor.__ray_actor_class__.__new__(D3SPolicyModelActor.__ray_actor_class__)
    strategy = MiniStrategy(args)
    worker.init_model_from_pretrained(strategy, model_dir, max_steps=max_steps)
    assert type(worker.trainer) is D3SActorPPOTrainer
    assert type(worker.trainer.actor_loss_fn) is D3SPolicyLoss
    assert strategy.prepared_cfg["scheduler_steps"] == max_steps == worker.max_steps
    assert ppo_actor.ActorPPOTrainer is not D3SActorPPOTrainer
    assert ppo_actor.ActorPPOTrainer.__name__ == "ActorPPOTrainer"


if __name__ == "__main__":
    two_rank_worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
