"""D3SExperienceMaker and the D3S trainer step against the real OpenRLHF 0.11.2 classes.

Real objects: OpenRLHF's argument parser (host args), DeepspeedStrategy, RemoteExperienceMaker (the upstream
baseline and our superclass), RayActorGroup with its chunking over data-parallel ranks, BaseModelActor's
execute_batch, Experience, FixedKLController / AdaptiveKLController, BasePPOTrainer.train_step, in a local Ray
cluster with fake GPU resources. The model actors are small Ray actors (subclasses of OpenRLHF's BaseModelActor)
whose forward returns deterministic log-probs / entropies / rewards computed from the token ids and records which
rollouts it received; nothing of OpenRLHF itself is mocked.

Rollout encoding: token 0 of a rollout is its reward code (reward = (code - 21) / 10), token 1 is its id + 1.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import ray
import torch
from openrlhf.trainer.ppo_trainer import BasePPOTrainer
from openrlhf.trainer.ppo_utils.experience import Experience, balance_experiences
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.kl_controller import (
    AdaptiveKLController,
    FixedKLController,
)
from openrlhf.trainer.ray.launcher import RayActorGroup
from openrlhf.utils import get_strategy

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.cpu import runtime
from d3s_openrlhf.integration.experience_maker import D3SExperienceMaker
from d3s_openrlhf.integration.host import PG_MASK_KEY, config_namespace, kept_count_unit, parse_host_args
from d3s_openrlhf.integration.trainer import D3STrainerMixin

ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")


# ── model actors ──


def _recording_actor_class():
    """A Ray actor class standing in for OpenRLHF's policy / reference / reward model actors.

    Defined in a function so that Ray pickles it by value (the test module is not importable in workers).
    """
    from openrlhf.trainer.ray.launcher import BaseModelActor

    class RecordingModelActor(BaseModelActor):
        def setup(self, salt):
            self.salt = salt
            self.calls = []
            self.strategy = SimpleNamespace(is_rank_0=lambda: False)  # execute_batch's progress bar

        def reset(self):
            self.calls = []

        def records(self):
            return self.calls

        def forward(
            self,
            sequences,
            action_mask=None,
            attention_mask=None,
            packed_seq_lens=None,
            mm_train_inputs_list=None,
            pad_sequence=None,
            return_entropy=False,
            chunked_logits=False,  # D3SReferenceModelActor's request for log-probs with chunked logits
        ):

            ids = (sequences[:, 1] - 1).tolist()
            if pad_sequence is not None:  # reward model
                self.calls.append(("reward", ids, False))
                return (sequences[:, 0] - 21).float() / 10
            self.calls.append(("log_probs", ids, return_entropy))
            if chunked_logits:
                self.calls.append(("chunked_logits", ids, False))
            # Position t of the action mask is token t + 1 (OpenRLHF's alignment): padding-invariant values.
            tokens = sequences[:, 1:].long()
            mask = action_mask.float()
            log_probs = -(((tokens * 7 + self.salt) % 13) + 1).float() / 10 * mask
            if not return_entropy:
                return log_probs
            entropy = ((((tokens * 5 + 3) % 17) + 1).float() / 7) * mask
            return log_probs, entropy

        def append(self, experience):
            self.calls.append(("append", len(experience.sequences), False))

        def fit(self, kl_ctl=0):
            self.calls.append(("fit", kl_ctl, False))
            return {"kl": 0.5, "policy_loss": 0.25}

    return ray.remote(num_gpus=1)(RecordingModelActor)


@pytest.fixture(scope="module")
def groups():
    """Policy group (2 data-parallel ranks) and one auxiliary actor serving as reference and reward model."""
    runtime.init_local_ray(num_cpus=3, num_gpus=3, include_dashboard=False, object_store_memory=150 * 1024**2)
    actor_class = _recording_actor_class()
    policy = RayActorGroup(1, 2, actor_class)
    aux = RayActorGroup(1, 1, actor_class)
    ray.get(policy.async_run_method("setup", salt=0) + aux.async_run_method("setup", salt=5))
    yield SimpleNamespace(policy=policy, aux=aux)
    ray.shutdown()


def _records(group):
    """Per rank: the list of recorded calls (and reset them)."""
    records = ray.get(group.async_run_method("records"))
    ray.get(group.async_run_method("reset"))
    return records


# ── host args, rollouts ──


def host_args(*flags, estimator="group_norm", group_size=4, prompts=4, train_batch=4, rollout_micro=1):
    argv = [
        "--algo.advantage.estimator",
        estimator,
        "--rollout.n_samples_per_prompt",
        str(group_size),
        "--rollout.batch_size",
        str(prompts),
        "--train.batch_size",
        str(train_batch),
        "--train.micro_batch_size",
        "1",
        "--rollout.micro_batch_size",
        str(rollout_micro),
        "--actor.num_nodes",
        "1",
        "--actor.num_gpus_per_node",
        "2",
        # the auxiliary group (one rank) serves as reference, critic and reward model
        "--ref.num_gpus_per_node",
        "1",
        "--critic.num_gpus_per_node",
        "1",
        "--reward.num_gpus_per_node",
        "1",
        *flags,
    ]
    return parse_host_args(argv)


def make_rollouts(rewards, *, precomputed=True, response_lengths=None, truncated=None):
    """One Experience per rollout, shaped like OpenRLHF's SamplesGenerator output; rewards (B, G) list."""
    rollouts = []
    flat = [r for row in rewards for r in row]
    group_size = len(rewards[0])
    for rollout_id, reward in enumerate(flat):
        prompt_len = 3 + rollout_id % 2
        response_len = response_lengths[rollout_id] if response_lengths else 2 + (rollout_id * 3) % 5
        code = round(reward * 10) + 21
        assert abs((code - 21) / 10 - reward) < 1e-9, "rewards must be multiples of 0.1 in [-2, ...]"
        body = [(rollout_id * 11 + j * 5) % 29 + 1 for j in range(prompt_len - 2 + response_len)]
        sequences = torch.tensor([code, rollout_id + 1, *body])
        attention_mask = torch.ones_like(sequences)
        action_mask = torch.zeros_like(attention_mask)
        action_mask[prompt_len:] = 1
        action_mask = action_mask[1:]
        is_truncated = bool(truncated[rollout_id]) if truncated else False
        info = {"response_clip_ratio": torch.tensor([False])}
        if precomputed:
            info["reward"] = torch.tensor([reward])
        rollouts.append(
            Experience(
                sequences=sequences.unsqueeze(0),
                attention_mask=attention_mask.unsqueeze(0),
                action_mask=action_mask.unsqueeze(0),
                prompts=[f"prompt {rollout_id // group_size}"],
                labels=[""],
                images=[None],
                mm_train_inputs=[None],
                rewards=torch.tensor([reward]) if precomputed else None,
                response_length=torch.tensor([response_len]),
                truncated=torch.tensor([is_truncated]),
                total_length=torch.tensor([float(len(sequences))]),
                info=info,
            )
        )
    return rollouts


class _Tokenizer:
    """What the experience maker and the trainer step use of a tokenizer."""

    pad_token_id = 0

    def decode(self, sequences, skip_special_tokens=True):
        return [" ".join(map(str, row.tolist())) for row in sequences]


def make_maker(groups, args, config, *, kl=0.0, ref=False, reward_model=False, critic=False, upstream=False):
    parts = (
        groups.policy,
        groups.aux if critic else None,
        groups.aux if reward_model else None,
        groups.aux if ref else None,
        FixedKLController(kl),
        get_strategy(args),
        _Tokenizer(),
    )
    if upstream:
        return RemoteExperienceMaker(*parts)
    return D3SExperienceMaker(*parts, d3s_config=config)


def config(**fields):
    return D3SConfig.from_flags(fields)


def ids_of(experience):
    return (experience.sequences[:, 1] - 1).tolist()


def by_rollout(experiences, attribute):
    """{rollout id: per-row tensor of ``attribute`` trimmed to the row's own action length}."""
    rows = {}
    for experience in experiences:
        values = getattr(experience, attribute) if attribute != "pg_mask" else experience.info[PG_MASK_KEY]
        for row, rollout_id in enumerate(ids_of(experience)):
            length = int(experience.action_mask[row].nonzero().max()) + 1
            rows[rollout_id] = values[row, :length]
    return rows


def kept_ids(experiences):
    return sorted(i for e in experiences for i in ids_of(e))


def forwarded_ids(records, role):
    return sorted(i for rank in records for kind, ids, _ in rank if kind == role for i in ids)


# ── hand computations ──

# Rewards (B = 4 prompts, G = 4): real-valued, one group with all rewards equal.
REWARDS = [[1.0, 0.2, 0.0, 0.7], [0.0, 1.3, 0.9, 0.4], [0.5, 0.5, 0.5, 0.5], [1.1, 0.3, -0.6, 0.2]]
# Rewards whose extremes lie in different groups: cross-group max-variance selection of 4 keeps 1, 1, 0 and 2
# rollouts of the four groups, on rewards (mode subset) and on full-group advantages (mode group) alike.
SPREAD = [[2.0, 0.5, 0.5, 0.6], [-1.0, 0.5, 0.4, 0.6], [0.5, 0.5, 0.5, 0.5], [1.9, -0.9, 0.5, 0.4]]


def hand_advantage(estimator, reward, pool):
    """Scalar advantage of ``reward`` against the rewards ``pool`` of its (full or kept) group."""
    n = len(pool)
    if n == 1:
        return 0.0  # no baseline signal in a one-member group (our documented rule)
    mean = sum(pool) / n
    if estimator == "group_norm":
        std = math.sqrt(sum((x - mean) ** 2 for x in pool) / (n - 1))
        return (reward - mean) / (std + 1e-9)
    if estimator == "rloo":
        return reward - (sum(pool) - reward) / (n - 1)
    return reward - mean  # dr_grpo, reinforce_baseline


def population_variance(values):
    mean = sum(values) / len(values)
    return sum((x - mean) ** 2 for x in values) / len(values)


def hand_token_advantages(estimator, rewards, kept, mode, experiences):
    """{rollout id: expected per-token advantages} with no KL term.

    The outcome reward sits on the last response token and returns are reverse cumulative sums (gamma 1), so
    every position up to the last response token carries the scalar advantage, later (padding) positions 0.
    """
    group_size = len(rewards[0])
    flat = [r for row in rewards for r in row]
    expected = {}
    for experience in experiences:
        for row, rollout_id in enumerate(ids_of(experience)):
            b = rollout_id // group_size
            pool = rewards[b] if mode == "group" else [flat[i] for i in kept if i // group_size == b]
            scalar = hand_advantage(estimator, flat[rollout_id], pool)
            last = int(experience.action_mask[row].nonzero().max())
            expected[rollout_id] = scalar * (torch.arange(experience.action_mask.shape[1]) <= last).double()
    if estimator == "reinforce_baseline":  # whitening over every response token of the trained rollouts
        masks = torch.cat([e.action_mask.flatten() for e in experiences]).double()
        values = torch.cat([torch.stack([expected[i] for i in ids_of(e)]).flatten() for e in experiences])
        mean = (values * masks).sum() / masks.sum()
        std = (((values - mean) ** 2 * masks).sum() / masks.sum()).sqrt()
        expected = {i: (v - mean) / std for i, v in expected.items()}
    return expected


def brute_force_max_variance(values, size):
    return max(population_variance(subset) for subset in itertools.combinations(values, size))


# ── off means identical ──


@pytest.mark.parametrize("precomputed", [True, False], ids=["remote-rewards", "reward-model"])
@pytest.mark.parametrize("flags", [dict(preset="grpo"), dict(preset="d3s")], ids=["d3s-off", "keep-everything"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_off_or_keeping_everything_equals_upstream_bit_for_bit(groups, estimator, flags, precomputed):
    args = host_args(estimator=estimator)
    ours = make_maker(groups, args, config(**flags), kl=0.05, ref=True, reward_model=not precomputed)
    ours.set_schedule_point(5, 4, 1.0)  # N = G and K = 1: nothing to select
    mine = ours.make_experience_batch(make_rollouts(REWARDS, precomputed=precomputed))
    my_calls = (_records(groups.policy), _records(groups.aux))

    upstream = make_maker(groups, args, None, kl=0.05, ref=True, reward_model=not precomputed, upstream=True)
    theirs = upstream.make_experience_batch(make_rollouts(REWARDS, precomputed=precomputed))
    assert (_records(groups.policy), _records(groups.aux)) == my_calls

    assert len(mine) == len(theirs) == 16  # --rollout.micro_batch_size 1
    for a, b in zip(mine, theirs):
        assert a.index == b.index
        for name in ("sequences", "action_mask", "attention_mask", "action_log_probs", "rewards"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for name in ("advantages", "returns"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert a.base_action_log_probs is None and b.base_action_log_probs is None
        assert set(a.info) == set(b.info) and PG_MASK_KEY not in a.info
        for key in a.info:
            assert torch.equal(a.info[key], b.info[key]), key
    if flags["preset"] == "grpo":
        assert ours.last_metrics == {}
    else:
        assert ours.last_metrics["d3s/kept_rollouts"] == 16 and ours.last_metrics["d3s/kept_token_frac"] == 1.0


# ── selection before the forwards ──


@pytest.mark.parametrize("precomputed", [True, False], ids=["remote-rewards", "reward-model"])
def test_only_kept_rollouts_reach_the_actor_and_reference_forwards(groups, precomputed):
    args = host_args()
    maker = make_maker(groups, args, config(preset="d3s"), kl=0.05, ref=True, reward_model=not precomputed)
    maker.set_schedule_point(0, 1, 1.0)
    experiences = maker.make_experience_batch(make_rollouts(REWARDS, precomputed=precomputed))
    kept = kept_ids(experiences)
    assert len(kept) == 4  # N * B = 4, already a multiple of lcm(train 4, micro 1 x dp 2)

    policy, aux = _records(groups.policy), _records(groups.aux)
    assert forwarded_ids(policy, "log_probs") == kept
    assert forwarded_ids(aux, "log_probs") == kept  # reference model
    assert forwarded_ids(aux, "chunked_logits") == []  # K = 1: upstream's forwards
    roles = [kind for kind, _, _ in aux[0]]
    if precomputed:
        assert "reward" not in roles
    else:  # the reward model alone saw every rollout, before the reference forward
        assert forwarded_ids(aux, "reward") == list(range(16))
        assert roles == sorted(roles, key=lambda kind: kind != "reward")
    flat = [r for row in REWARDS for r in row]
    for experience in experiences:
        expected = torch.tensor([flat[i] for i in ids_of(experience)])
        assert torch.allclose(experience.rewards, expected)
        assert torch.equal(experience.info["reward"], experience.rewards)
        assert experience.action_log_probs.shape == experience.action_mask.shape


# ── advantages ──


@pytest.mark.parametrize("scope", ["cross", "intra"])
@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo"])
def test_group_mode_trains_upstream_full_group_advantages(groups, estimator, scope):
    """Mode group (D3S): a kept rollout gets exactly the advantages upstream computes with all rollouts."""
    args = host_args(estimator=estimator)
    ours = make_maker(groups, args, config(preset="d3s", sample_scope=scope), kl=0.05, ref=True)
    ours.set_schedule_point(0, 2, 1.0)
    mine = ours.make_experience_batch(make_rollouts(REWARDS))
    upstream = make_maker(groups, args, None, kl=0.05, ref=True, upstream=True)
    theirs = upstream.make_experience_batch(make_rollouts(REWARDS))
    _records(groups.policy), _records(groups.aux)

    kept = kept_ids(mine)
    assert len(kept) == 8
    for name in ("advantages", "returns", "action_log_probs"):
        ours_rows, upstream_rows = by_rollout(mine, name), by_rollout(theirs, name)
        for rollout_id in kept:
            assert torch.equal(ours_rows[rollout_id], upstream_rows[rollout_id]), (name, rollout_id)
    upstream_info = {i: e for e in theirs for i in ids_of(e)}
    for experience in mine:
        for row, rollout_id in enumerate(ids_of(experience)):
            reference = upstream_info[rollout_id]
            ref_row = ids_of(reference).index(rollout_id)
            for key in ("group_reward_std", "return", "kl"):
                assert torch.equal(experience.info[key][row], reference.info[key][ref_row]), key


@pytest.mark.parametrize("mode", ["group", "subset"])
@pytest.mark.parametrize("scope", ["cross", "intra"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_match_a_hand_computation(groups, estimator, scope, mode):
    args = host_args(estimator=estimator)
    flags = dict(preset="d3s", sample_scope=scope, advantage_mode=mode)
    maker = make_maker(groups, args, config(**flags))
    maker.set_schedule_point(0, 2, 1.0)
    experiences = maker.make_experience_batch(make_rollouts(REWARDS))
    _records(groups.policy)
    kept = kept_ids(experiences)
    assert len(kept) == 8
    if scope == "intra":
        assert [sum(1 for i in kept if i // 4 == b) for b in range(4)] == [2, 2, 2, 2]

    # The kept set maximises the variance of the selection values (full-group advantages for mode group,
    # rewards for mode subset), within each prompt (intra) or over the pooled batch (cross).
    flat = [r for row in REWARDS for r in row]
    values = [hand_advantage(estimator, r, REWARDS[i // 4]) if mode == "group" else r for i, r in enumerate(flat)]
    if scope == "cross":
        assert population_variance([values[i] for i in kept]) == pytest.approx(brute_force_max_variance(values, 8))
    else:
        for b in range(4):
            row = [values[i] for i in kept if i // 4 == b]
            assert population_variance(row) == pytest.approx(brute_force_max_variance(values[4 * b : 4 * b + 4], 2))

    expected = hand_token_advantages(estimator, REWARDS, kept, mode, experiences)
    for rollout_id, advantages in by_rollout(experiences, "advantages").items():
        length = advantages.shape[0]
        assert torch.allclose(advantages.double(), expected[rollout_id][:length], atol=1e-5), rollout_id


@pytest.mark.parametrize("mode", ["group", "subset"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_cross_groups_keeping_zero_or_one_rollout_stay_finite(groups, estimator, mode):
    args = host_args(estimator=estimator)
    maker = make_maker(groups, args, config(preset="d3s", advantage_mode=mode))
    maker.set_schedule_point(0, 1, 1.0)
    experiences = maker.make_experience_batch(make_rollouts(SPREAD))
    _records(groups.policy)
    kept = kept_ids(experiences)
    assert [sum(1 for i in kept if i // 4 == b) for b in range(4)] == [1, 1, 0, 2]
    advantages = by_rollout(experiences, "advantages")
    assert all(torch.isfinite(a).all() for a in advantages.values())
    expected = hand_token_advantages(estimator, SPREAD, kept, mode, experiences)
    for rollout_id in kept:
        length = len(advantages[rollout_id])
        assert torch.allclose(advantages[rollout_id].double(), expected[rollout_id][:length], atol=1e-5)
    if mode == "subset" and estimator != "reinforce_baseline":
        assert not advantages[0].any() and not advantages[4].any()  # one-member groups: no baseline, advantage 0


@pytest.mark.parametrize("n", [1, 2, 4], ids=["N=1", "N=2", "N=G"])
@pytest.mark.parametrize("scope", ["cross", "intra"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_all_equal_rewards_and_one_token_responses_keep_no_token(groups, estimator, scope, n):
    """Every reward equal, every response one token long: advantages are 0 (finite), every kept count is legal
    and no token carries a score, so none enters the PG term (the trainer then trains no PG term)."""
    args = host_args(estimator=estimator)
    maker = make_maker(groups, args, config(preset="d3s", sample_scope=scope))
    maker.set_schedule_point(3, n, 0.3)
    equal = [[0.5] * 4 for _ in range(4)]
    experiences = maker.make_experience_batch(make_rollouts(equal, response_lengths=[1] * 16))
    _records(groups.policy)
    assert len(kept_ids(experiences)) == max(4, 4 * n)  # rounded up to the unit lcm(4, 1 x 2) = 4
    for experience in experiences:
        assert torch.equal(experience.advantages, torch.zeros_like(experience.advantages))
        assert not experience.info[PG_MASK_KEY].any()
    metrics = maker.last_metrics
    assert metrics["d3s/candidate_tokens"] == max(4, 4 * n)
    assert metrics["d3s/scored_tokens"] == metrics["d3s/kept_tokens"] == 0
    assert metrics["d3s/zero_var_groups"] == 4 and metrics["d3s/adv_var_all"] == 0.0
    assert all(math.isfinite(value) for value in metrics.values())


def test_length_penalties_land_exactly_once(groups):
    lengths = [2, 3, 5, 6] * 4
    args = host_args("--reward.overlong_buffer_len", "2", "--rollout.max_new_tokens", "6")
    ours = make_maker(groups, args, config(preset="d3s"))
    ours.set_schedule_point(0, 2, 1.0)
    mine = ours.make_experience_batch(make_rollouts(REWARDS, response_lengths=lengths))
    upstream = make_maker(groups, args, None, upstream=True)
    theirs = upstream.make_experience_batch(make_rollouts(REWARDS, response_lengths=lengths))
    _records(groups.policy)

    flat = [r for row in REWARDS for r in row]
    penalised = {i: flat[i] - max(0, lengths[i] - 4) / 2 for i in range(16)}  # DAPO: -(len - 4) / 2, len > 4
    upstream_rewards = {i: e.rewards[row] for e in theirs for row, i in enumerate(ids_of(e))}
    for experience in mine:
        for row, rollout_id in enumerate(ids_of(experience)):
            assert experience.rewards[row].item() == pytest.approx(penalised[rollout_id])
            assert torch.equal(experience.rewards[row], upstream_rewards[rollout_id])
            assert torch.equal(experience.info["reward"][row], experience.rewards[row])
    ours_rows, upstream_rows = by_rollout(mine, "advantages"), by_rollout(theirs, "advantages")
    assert all(torch.equal(ours_rows[i], upstream_rows[i]) for i in kept_ids(mine))


# ── batch invariant ──


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-batches", "dynamic-batch"])
@pytest.mark.parametrize("scope", ["cross", "intra"])
def test_kept_counts_split_evenly_over_two_ranks(groups, scope, dynamic):
    flags = ("--train.dynamic_batch_enable", "--rollout.max_tokens_per_gpu", "20") if dynamic else ()
    args = host_args(*flags, group_size=4, prompts=3, train_batch=2, rollout_micro=2)
    unit = kept_count_unit(args, D3SConfig())
    assert unit == (2 if dynamic else 4)  # lcm(2, dp 2) / lcm(2, 2 x dp 2)
    dp, per_rank_window = 2, 2 // 2  # train.batch_size / dp samples per rank per optimizer step
    maker = make_maker(groups, args, config(preset="d3s", sample_scope=scope))
    seen = set()
    for n in (1, 2, 3, 4):
        maker.set_schedule_point(n, n, 1.0)
        experiences = maker.make_experience_batch(make_rollouts(REWARDS[:3]))
        kept = kept_ids(experiences)
        seen.add(len(kept))
        assert len(kept) % unit == 0 and n * 3 <= len(kept) < n * 3 + unit
        if scope == "intra":
            counts = [sum(1 for i in kept if i // 4 == b) for b in range(3)]
            assert set(counts) <= {len(kept) // 3, len(kept) // 3 + 1}
        forwards = [sum(1 for kind, _, _ in rank if kind == "log_probs") for rank in _records(groups.policy)]
        assert forwards[0] == forwards[1] > 0, forwards  # the same number of forward micro-batches per rank

        # What train_step hands to the actors, chunked by upstream's RayActorGroup.
        if dynamic:
            experiences = balance_experiences(experiences, args)
        ray.get(groups.policy.async_run_method_batch(method_name="append", experience=experiences))
        appended = [sum(size for kind, size, _ in rank if kind == "append") for rank in _records(groups.policy)]
        assert appended[0] == appended[1] == len(kept) // dp
        assert appended[0] % per_rank_window == 0  # whole gradient-accumulation windows on every rank
    assert len(seen) > 1


# ── token mask and entropy ──


@pytest.mark.parametrize("token_scope", ["batch", "sequence"])
def test_token_mask_from_the_actor_forward_entropy(groups, token_scope):
    args = host_args()
    maker = make_maker(groups, args, config(preset="d3s", token_scope=token_scope), kl=0.05, ref=True)
    maker.set_schedule_point(0, 2, 0.25)
    experiences = maker.make_experience_batch(make_rollouts(REWARDS))
    policy, aux = _records(groups.policy), _records(groups.aux)
    assert all(entropy for rank in policy for kind, _, entropy in rank if kind == "log_probs")
    assert not any(entropy for rank in aux for _, _, entropy in rank)  # the reference returns no entropy...
    # ...and is asked for its log-probs with chunked logits, like the actor at a step with token selection
    assert forwarded_ids(aux, "chunked_logits") == forwarded_ids(aux, "log_probs") == kept_ids(experiences)

    kept_scores, dropped_scores = [], []
    kept_total = valid_total = 0
    entropy_sum = kept_entropy_sum = 0.0
    for experience in experiences:
        mask = experience.info[PG_MASK_KEY]
        valid = experience.action_mask.bool()
        assert mask.dtype == torch.bool and mask.shape == valid.shape and not (mask & ~valid).any()
        tokens = experience.sequences[:, 1:].long()
        expected_log_probs = -(((tokens * 7) % 13) + 1).float() / 10 * valid.float()
        assert torch.equal(experience.action_log_probs, expected_log_probs)  # log-probs split from the entropy
        entropy = ((((tokens * 5 + 3) % 17) + 1).float() / 7) * valid.float()
        score = experience.advantages.abs() * entropy
        for row in range(len(mask)):
            row_valid, row_kept = int(valid[row].sum()), int(mask[row].sum())
            if token_scope == "sequence":
                assert row_kept == math.ceil(row_valid / 4)
                dropped = score[row][valid[row] & ~mask[row]]
                assert dropped.numel() == 0 or score[row][mask[row]].min() >= dropped.max()
        kept_scores.append(score[mask])
        dropped_scores.append(score[valid & ~mask])
        kept_total += int(mask.sum())
        valid_total += int(valid.sum())
        entropy_sum += float(entropy[valid].sum())
        kept_entropy_sum += float(entropy[mask].sum())
    if token_scope == "batch":
        assert kept_total == math.ceil(valid_total / 4)
        assert torch.cat(kept_scores).min() >= torch.cat(dropped_scores).max()
    metrics = maker.last_metrics
    assert metrics["d3s/kept_tokens"] == kept_total
    assert metrics["d3s/entropy_all"] == pytest.approx(entropy_sum / valid_total)
    assert metrics["d3s/entropy_kept"] == pytest.approx(kept_entropy_sum / kept_total)


def test_token_selection_alone_keeps_every_rollout_and_upstream_advantages(groups):
    args = host_args(estimator="reinforce_baseline")
    maker = make_maker(groups, args, config(sample_rule="none", k_init=0.5, k_final=0.5), kl=0.05, ref=True)
    maker.set_schedule_point(0, 4, 0.5)
    mine = maker.make_experience_batch(make_rollouts(REWARDS))
    upstream = make_maker(groups, args, None, kl=0.05, ref=True, upstream=True)
    theirs = upstream.make_experience_batch(make_rollouts(REWARDS))
    _records(groups.policy), _records(groups.aux)
    assert kept_ids(mine) == list(range(16))
    for a, b in zip(mine, theirs):
        assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)
    valid = sum(int(e.action_mask.sum()) for e in mine)
    assert sum(int(e.info[PG_MASK_KEY].sum()) for e in mine) == math.ceil(valid / 2)


def test_token_selection_with_gae_and_a_critic(groups):
    args = host_args(estimator="gae")
    flags = dict(sample_rule="none", k_init=0.5, k_final=0.5)
    maker = make_maker(groups, args, config(**flags), kl=0.05, ref=True, critic=True)
    maker.set_schedule_point(0, 4, 0.5)
    mine = maker.make_experience_batch(make_rollouts(REWARDS))
    upstream = make_maker(groups, args, None, kl=0.05, ref=True, critic=True, upstream=True)
    theirs = upstream.make_experience_batch(make_rollouts(REWARDS))
    _records(groups.policy), _records(groups.aux)
    for a, b in zip(mine, theirs):
        for name in ("advantages", "returns", "values"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    valid = sum(int(e.action_mask.sum()) for e in mine)
    assert sum(int(e.info[PG_MASK_KEY].sum()) for e in mine) == math.ceil(valid / 2)
    assert "d3s/adv_var_all" not in maker.last_metrics  # no group-relative scalar advantage for gae


@pytest.mark.parametrize("rule", ["max_reward", "random"])
def test_ablation_rules(groups, rule):
    args = host_args()
    maker = make_maker(groups, args, config(preset="d3s", sample_rule=rule))
    maker.set_schedule_point(0, 2, 1.0)
    kept = kept_ids(maker.make_experience_batch(make_rollouts(REWARDS)))
    _records(groups.policy)
    assert len(kept) == 8
    if rule == "max_reward":  # the 8 largest full-group advantages
        flat = [r for row in REWARDS for r in row]
        values = [hand_advantage("group_norm", r, REWARDS[i // 4]) for i, r in enumerate(flat)]
        assert min(values[i] for i in kept) >= max(values[i] for i in range(16) if i not in kept)


def test_sample_selection_needs_a_group_estimator():
    args = host_args(estimator="reinforce")
    strategy, d1s = get_strategy(args), config(preset="d1s")
    with pytest.raises(ValueError, match="needs a group estimator"):
        D3SExperienceMaker(None, None, None, None, FixedKLController(0.0), strategy, _Tokenizer(), d3s_config=d1s)


# ── reproducibility and metrics ──


def test_tie_breaking_is_reproducible_from_seed_and_step(groups):
    binary = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]
    args = host_args()

    def kept_at(seed, step):
        maker = make_maker(groups, args, config(preset="d3s", seed=seed))
        maker.set_schedule_point(step, 1, 1.0)
        kept = kept_ids(maker.make_experience_batch(make_rollouts(binary)))
        _records(groups.policy)
        return kept

    first = kept_at(3, 7)
    assert kept_at(3, 7) == first
    others = {tuple(kept_at(seed, step)) for seed, step in ((3, 8), (4, 7), (5, 7), (3, 9))}
    assert others - {tuple(first)}  # every rollout ties with others: the seeded order decides


def test_metrics(groups):
    args = host_args()
    maker = make_maker(groups, args, config(preset="d3s"))
    maker.set_schedule_point(0, 2, 0.5)
    rollouts = make_rollouts(REWARDS)
    all_tokens = sum(int(r.action_mask.sum()) for r in rollouts)
    experiences = maker.make_experience_batch(rollouts)
    _records(groups.policy)
    metrics = maker.last_metrics
    assert set(metrics) == {
        "d3s/n",
        "d3s/k",
        "d3s/kept_rollouts",
        "d3s/kept_rollout_frac",
        "d3s/candidate_tokens",
        "d3s/kept_tokens",
        "d3s/kept_token_frac",
        "d3s/adv_var_all",
        "d3s/adv_var_kept",
        "d3s/entropy_all",
        "d3s/entropy_kept",
        "d3s/scored_tokens",
        "d3s/zero_var_groups",
        "d3s/select_time_s",
    }
    kept = kept_ids(experiences)
    flat = [r for row in REWARDS for r in row]
    advantages = [hand_advantage("group_norm", r, REWARDS[i // 4]) for i, r in enumerate(flat)]
    assert (metrics["d3s/n"], metrics["d3s/k"]) == (2.0, 0.5)
    assert (metrics["d3s/kept_rollouts"], metrics["d3s/kept_rollout_frac"]) == (8.0, 0.5)
    assert metrics["d3s/candidate_tokens"] == sum(int(e.action_mask.sum()) for e in experiences)
    assert metrics["d3s/kept_tokens"] == sum(int(e.info[PG_MASK_KEY].sum()) for e in experiences)
    assert metrics["d3s/kept_tokens"] == math.ceil(0.5 * metrics["d3s/candidate_tokens"])  # K = 0.5, batch scope
    assert metrics["d3s/kept_token_frac"] == pytest.approx(metrics["d3s/kept_tokens"] / all_tokens)
    assert metrics["d3s/adv_var_all"] == pytest.approx(population_variance(advantages), rel=1e-6)
    assert metrics["d3s/adv_var_kept"] == pytest.approx(population_variance([advantages[i] for i in kept]), rel=1e-6)
    assert metrics["d3s/adv_var_kept"] > metrics["d3s/adv_var_all"]
    assert metrics["d3s/zero_var_groups"] == 1.0
    assert 0.0 <= metrics["d3s/select_time_s"] < 5.0


# ── the trainer step (BasePPOTrainer.train_step with the D3S mixin) ──


class _StepTrainer(D3STrainerMixin, BasePPOTrainer):
    """OpenRLHF's BasePPOTrainer (whose train_step both the sync and the async trainer run) with D3S."""


def make_trainer(groups, d3s_flags, *flags):
    args = host_args("--algo.kl.target", "0.1", "--algo.kl.horizon", "1000", "--algo.kl.init_coef", "0.2", *flags)
    args.d3s = config_namespace(config(**d3s_flags))
    trainer = _StepTrainer(get_strategy(args), groups.policy, None, None, groups.aux, None, _Tokenizer())
    trainer.set_d3s_rollout_steps(4)
    return trainer


SCHEDULE = dict(preset="d3s", n_init=1, n_final=4, k_init=0.25, k_final=1.0)


def test_trainer_step_sets_schedule_logs_metrics_and_updates_kl_with_kept_count(groups):
    trainer = make_trainer(groups, SCHEDULE)
    assert isinstance(trainer.experience_maker, D3SExperienceMaker)
    assert isinstance(trainer.kl_ctl.inner, AdaptiveKLController)
    assert trainer.experience_maker.kl_ctl is trainer.kl_ctl
    _records(groups.policy), _records(groups.aux)

    status, next_step = trainer.train_step(make_rollouts(REWARDS), 0)
    assert next_step == 1
    assert (status["d3s/n"], status["d3s/k"], status["d3s/kept_rollouts"]) == (1.0, 0.25, 4.0)
    assert status["rollout/num_samples"] == 16.0  # rollout statistics describe all B*G rollouts of the batch
    assert status["rollout/reward_mean"] == pytest.approx(sum(sum(r) for r in REWARDS) / 16)
    assert status["policy_loss"] == 0.25 and "d3s/entropy_kept" in status
    # AdaptiveKLController.update(current=0.5, n_steps=trained rollouts): error clipped to 0.2, horizon 1000
    assert trainer.kl_ctl.value == pytest.approx(0.2 * (1 + 0.2 * 4 / 1000))
    calls = _records(groups.policy)
    _records(groups.aux)
    assert sum(size for rank in calls for kind, size, _ in rank if kind == "append") == 4
    assert [kl for rank in calls for kind, kl, _ in rank if kind == "fit"] == [0.2, 0.2]

    status, _ = trainer.train_step(make_rollouts(REWARDS), 3)  # the last of the run's 4 steps: N = G, K = 1
    assert (status["d3s/n"], status["d3s/k"], status["d3s/kept_rollouts"]) == (4.0, 1.0, 16.0)
    assert "d3s/entropy_all" not in status
    _records(groups.policy), _records(groups.aux)


def test_trainer_resumed_at_a_step_continues_the_schedule(groups):
    binary = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]
    runs = []
    for steps in ((0, 1, 2), (2,)):  # a run from the start, and one resumed from a checkpoint at step 2
        trainer = make_trainer(groups, SCHEDULE)
        for step in steps:
            status, _ = trainer.train_step(make_rollouts(binary), step)
            forwarded = forwarded_ids(_records(groups.policy), "log_probs")
            _records(groups.aux)
        runs.append((status["d3s/n"], status["d3s/k"], forwarded))
    assert runs[0] == runs[1]
    assert runs[0][:2] == (3.0, 0.75)  # step 2 of 4: p = 2/3, N = 1 + 2/3 * 3 = 3, K = 0.25 + 2/3 * 0.75


# ── bad rewards, the entropy hand-off ──


@pytest.mark.parametrize("n", [2, 4], ids=["selecting", "keeping-all"])
def test_non_finite_rewards_stop_the_step_before_any_forward(groups, n):
    args = host_args("--reward.remote_url", "/path/reward.py")
    maker = make_maker(groups, args, config(preset="d3s"))
    maker.set_schedule_point(7, n, 0.5)
    rollouts = make_rollouts(REWARDS)
    for i, value in ((5, float("nan")), (9, float("inf"))):
        rollouts[i].rewards = torch.tensor([value])
    with pytest.raises(ValueError) as error:
        maker.make_experience_batch(rollouts)
    message = str(error.value)
    assert "2 of 16 rewards at step 7 are NaN or infinite" in message
    assert "--reward.remote_url /path/reward.py" in message and "5 (prompt 1), 9 (prompt 2)" in message
    assert _records(groups.policy) == [[], []]  # nothing was forwarded


def test_entropy_pairs_are_split_in_this_process_from_the_actors_own_refs(groups, monkeypatch):
    """The log-prob refs upstream's make_experience gathers are the actor forward's own (no extra Ray task); with
    ring-attention copies (two ranks computing the same chunk) each pair is fetched once."""
    args = host_args("--ds.ring_attn_size", "2", "--algo.kl.init_coef", "0")
    maker = make_maker(groups, args, config(preset="d3s"))
    maker.set_schedule_point(0, 2, 0.5)
    dispatched, gathered = [], []
    run_batch = groups.policy.async_run_method_batch
    monkeypatch.setattr(groups.policy, "duplicate_actors", 2)  # both ranks get every chunk, as ring copies do
    monkeypatch.setattr(
        groups.policy, "async_run_method_batch", lambda **kw: dispatched.append(run_batch(**kw)) or dispatched[-1]
    )
    flatten = maker._flatten_results
    monkeypatch.setattr(maker, "_flatten_results", lambda refs, dup: gathered.append(refs) or flatten(refs, dup))
    experiences = maker.make_experience_batch(make_rollouts(REWARDS))
    records = _records(groups.policy)
    assert forwarded_ids(records[:1], "log_probs") == forwarded_ids(records[1:], "log_probs")  # duplicated work
    assert len(dispatched) == 1 and any(refs is dispatched[0] for refs in gathered)
    for experience in experiences:  # one entropy row per kept rollout, aligned with its log-probs
        tokens = experience.sequences[:, 1:].long()
        valid = experience.action_mask.float()
        assert torch.equal(experience.action_log_probs, -(((tokens * 7) % 13) + 1).float() / 10 * valid)
    assert maker.last_metrics["d3s/kept_rollouts"] == 8
