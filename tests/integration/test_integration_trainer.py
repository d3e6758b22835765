"""The D3S trainers as Ray actors, built the way ``openrlhf.cli.train_ppo_ray`` builds OpenRLHF's.

``D3SPPOTrainer.remote(...)`` and ``D3SPPOTrainerAsync.remote(...)`` run the real upstream constructors
(tokenizer, prompt dataset and dataloader, SamplesGenerator; for async the generator and training actors, the
queues and the vLLM lock) in Ray workers, with a tiny local tokenizer and prompt file. The model groups are not
needed for construction and are None. The step logic itself is tested in test_integration_experience_maker.py.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import ray
from openrlhf.utils import get_strategy

from d3s_openrlhf.cli.train_ppo_ray import parse_host_args
from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration.experience_maker import config_from_args, config_namespace
from d3s_openrlhf.integration.actor import D3SPolicyModelActor
from d3s_openrlhf.integration.trainer import (
    D3SGenerateSamplesActor,
    D3SPPOTrainer,
    D3SPPOTrainerAsync,
    D3STrainingActor,
    scaled_max_steps,
)


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    """A word-level tokenizer directory and a 10-prompt JSONL file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("d3s_trainer")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(root / "tokenizer")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"w{i} w{i + 1}"}) + "\n" for i in range(10)))
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=150 * 1024**2)
    yield str(root / "tokenizer"), str(prompts)
    ray.shutdown()


def _strategy(model, prompts, *flags, **d3s):
    args = parse_host_args(
        [
            "--actor.model_name_or_path",
            model,
            "--data.prompt_dataset",
            prompts,
            "--data.input_key",
            "input",
            "--algo.advantage.estimator",
            "group_norm",
            "--rollout.batch_size",
            "4",
            "--rollout.n_samples_per_prompt",
            "4",
            "--train.batch_size",
            "4",
            "--actor.num_gpus_per_node",
            "1",
            "--train.num_episodes",
            "2",
            *flags,
        ]
    )
    args.d3s = config_namespace(D3SConfig.from_flags({"preset": "d3s", "n_init": 1, "n_final": 4, **d3s}))
    return get_strategy(args)


def _inspector():
    """A function run inside a trainer actor (local, so that Ray pickles it by value)."""

    def inspect(trainer):
        return type(trainer).__name__, type(trainer.experience_maker).__name__, trainer.d3s_rollout_steps

    return inspect


def _super_checker():
    """A function run inside an actor: methods whose zero-argument ``super()`` is bound to a class outside the
    actor's MRO (calling them raises ``TypeError: super(type, obj)``)."""

    def unbound_super_methods(instance):
        import inspect as inspect_module

        mro = type(instance).__mro__
        broken = []
        for name, member in inspect_module.getmembers(type(instance), callable):
            function = inspect_module.unwrap(member)  # Ray's tracing wrapper sets __wrapped__
            code = getattr(function, "__code__", None)
            if code is None or "__class__" not in code.co_freevars:
                continue
            bound = function.__closure__[code.co_freevars.index("__class__")].cell_contents
            if bound not in mro:
                broken.append(f"{name} (super() bound to a copy of {bound.__qualname__})")
        return broken

    return unbound_super_methods


def _pickled_by_reference(cls):
    """Whether cloudpickle ships ``cls`` by reference: its module attribute of that name is the class itself."""
    found = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


@pytest.mark.parametrize(
    "actor_class", [D3SPolicyModelActor, D3SPPOTrainer, D3SPPOTrainerAsync, D3STrainingActor, D3SGenerateSamplesActor]
)
def test_no_inherited_method_binds_super_to_a_shipped_copy(actor_class):
    """Upstream's @ray.remote classes are not importable by name (the module attribute is the ActorClass), so
    Ray ships their methods by value, each ``super()`` bound to a copy of its class. If one of our importable
    subclasses sits between the actor and that class, the MRO holds the imported class, not the copy: any such
    inherited method that uses zero-argument ``super()`` must be overridden by an importable one."""
    cls = actor_class.__ray_actor_class__
    broken = []
    for name in dir(cls):
        owner_index, owner = next((i, c) for i, c in enumerate(cls.__mro__) if name in c.__dict__)
        code = getattr(owner.__dict__[name], "__code__", None)
        if code is None or "__class__" not in code.co_freevars or _pickled_by_reference(owner):
            continue
        if any(_pickled_by_reference(c) for c in cls.__mro__[:owner_index]):
            broken.append(f"{owner.__qualname__}.{name}")
    assert not broken, f"override these in {cls.__qualname__}: {broken}"


def test_sync_trainer_builds_the_d3s_experience_maker_and_horizon(run_files):
    model, prompts = run_files
    trainer = D3SPPOTrainer.remote(model, _strategy(model, prompts), None, None, None, None, None, max_len=64)
    name, maker, steps = ray.get(trainer.__ray_call__.remote(_inspector()))
    assert ray.get(trainer.__ray_call__.remote(_super_checker())) == []
    assert (name, maker) == ("_D3SPPOTrainer", "D3SExperienceMaker")
    assert steps == 6  # ceil(10 prompts / 4) rollout steps per episode, 2 episodes
    # the actors' LR horizon: upstream's 10 prompts x 4 / 4 x 2 episodes = 20, rescaled to the kept rollouts
    strategy = _strategy(model, prompts)
    expected = scaled_max_steps(strategy.args, config_from_args(strategy.args), 20, 6)
    assert expected < 20
    assert ray.get(trainer.get_max_steps.remote()) == expected
    ray.kill(trainer)


def test_async_trainer_builds_d3s_generator_and_training_actors(run_files):
    model, prompts = run_files
    strategy = _strategy(model, prompts, "--train.async_enable")
    trainer = D3SPPOTrainerAsync.remote(model, strategy, None, None, None, None, None, max_len=64)

    inspect = _inspector()
    check_super = _super_checker()

    def inside(wrapper):
        import openrlhf.trainer.ppo_trainer_async as module

        broken = check_super(wrapper)
        for actor in (wrapper.trainer_actor, wrapper.generator_actor):
            broken += ray.get(actor.__ray_call__.remote(check_super))
        assert not broken, broken
        training = ray.get(wrapper.trainer_actor.__ray_call__.remote(inspect))
        steps = ray.get(wrapper.generator_actor.d3s_rollout_steps.remote())
        globals_now = (
            module.TrainingActor.__ray_actor_class__.__name__,
            module.GenerateSamplesActor.__ray_actor_class__.__name__,
        )
        return training, steps, globals_now

    training, steps, globals_now = ray.get(trainer.__ray_call__.remote(inside))
    assert training == ("_D3STrainingActor", "D3SExperienceMaker", 6)
    assert steps == 6
    # PPOTrainerAsync.get_max_steps asks the generator actor: the same rescaled horizon as the sync trainer
    assert ray.get(trainer.get_max_steps.remote()) == scaled_max_steps(
        strategy.args, config_from_args(strategy.args), 20, 6
    )
    # In the wrapper's worker the module globals were swapped only for the duration of its constructor.
    assert globals_now == ("TrainingActor", "GenerateSamplesActor")
    ray.kill(trainer)


# ── the LR-scheduler horizon (get_max_steps) ──


def horizon_args(**overrides):
    args = SimpleNamespace(
        rollout=SimpleNamespace(batch_size=4, n_samples_per_prompt=8, micro_batch_size=1),
        train=SimpleNamespace(batch_size=8, max_epochs=2, dynamic_batch_enable=False),
        actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=2),
        ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
        algo=SimpleNamespace(kl=SimpleNamespace(init_coef=0.0), dynamic_filtering_enable=False),
        ref=SimpleNamespace(num_nodes=1, num_gpus_per_node=1),
        critic=SimpleNamespace(model_name_or_path=None, num_nodes=1, num_gpus_per_node=1),
    )
    for key, value in overrides.items():
        *path, name = key.split("__")
        target = args
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    return args


def test_max_steps_is_the_optimizer_steps_of_the_kept_rollouts():
    args = horizon_args()
    # upstream: 4 rollout steps x (4 prompts x 8 samples / 8 per optimizer step) x 2 epochs
    max_steps = 4 * (4 * 8 // 8) * 2
    cfg = D3SConfig(sample_rule="max_var", n_init=2, n_final=6, schedule="linear")
    # N over the 4 steps: 2, 3, 4, 5 -> N * B = 8, 12, 16, 20 -> multiples of lcm(8, 1 * 2) = 8: 8, 16, 16, 24;
    # 2 epochs x (8 + 16 + 16 + 24) / 8 = 16 optimizer steps
    assert scaled_max_steps(args, cfg, max_steps, 4) == 16
    # the exact step count matters: 10 prompts, B = 4, 3 episodes = 9 rollout steps (partial batches included),
    # while upstream's horizon floor(10 * 8 / 8) * 3 * 2 = 60 corresponds to 7.5 full ones
    schedule = cfg.schedule_for(9)
    kept = [max(8, -(-schedule.at(step)[0] * 4 // 8) * 8) for step in range(9)]
    assert scaled_max_steps(args, cfg, 60, 9) == min(60, 2 * sum(kept) // 8)


def test_max_steps_uses_schedule_steps_and_the_dynamic_batch_unit():
    args = horizon_args(train__dynamic_batch_enable=True, actor__num_gpus_per_node=4)
    max_steps = 4 * 4 * 2
    # schedule over 2 steps: N = 2, 4, then 6, 6 (p clipped at 1); unit lcm(8, 4) = 8: 8, 16, 24, 24
    cfg = D3SConfig(sample_rule="max_var", n_init=2, n_final=6, schedule="linear", schedule_steps=2)
    assert scaled_max_steps(args, cfg, max_steps, 4) == 2 * (8 + 16 + 24 + 24) // 8


def test_max_steps_with_a_constant_fraction_and_without_sample_selection():
    args = horizon_args(rollout__n_samples_per_prompt=16, train__batch_size=16)
    max_steps = 10 * (4 * 16 // 16) * 2
    pods = D3SConfig.from_flags({"preset": "pods", "n_init": 4, "n_final": 4})  # keeps 4 of 16 = 1/4 each step
    assert scaled_max_steps(args, pods, max_steps, 10) == max_steps // 4
    tokens_only = D3SConfig(sample_rule="none", k_init=0.1, k_final=0.3)
    assert scaled_max_steps(args, tokens_only, max_steps, 10) == max_steps
    # never above upstream's horizon, and 0 stays 0
    assert scaled_max_steps(args, pods, 1, 10) == 1
    assert scaled_max_steps(args, pods, 0, 10) == 0


def test_max_steps_with_dynamic_filtering_spans_the_schedule_steps():
    args = horizon_args(algo__dynamic_filtering_enable=True)
    # upstream's horizon over-counts under filtering (10 steps estimated); the schedule is set to span 3
    max_steps = 10 * (4 * 8 // 8) * 2
    cfg = D3SConfig(sample_rule="max_var", n_init=2, n_final=6, schedule="linear", schedule_steps=3)
    schedule = cfg.schedule_for(3)
    kept = [-(-schedule.at(step)[0] * 4 // 8) * 8 for step in range(3)]
    assert scaled_max_steps(args, cfg, max_steps, 10) == 2 * sum(kept) // 8
    # token selection alone: the same 3 steps of all B * G rollouts
    tokens_only = D3SConfig(sample_rule="none", k_init=0.1, k_final=0.3, schedule_steps=3)
    assert scaled_max_steps(args, tokens_only, max_steps, 10) == 3 * (4 * 8 // 8) * 2
    # without schedule_steps upstream's estimate stays (the CLI refuses a moving schedule then)
    assert scaled_max_steps(args, D3SConfig(sample_rule="none", k_init=0.1, k_final=0.3), max_steps, 10) == max_steps


def test_kept_count_unit_counts_every_group_that_runs_forwards_on_the_kept_rollouts():
    from d3s_openrlhf.integration.experience_maker import kept_count_unit

    # actor 2 ranks, micro-batch 1, train batch 8: lcm(8, 1 x 2) = 8
    assert kept_count_unit(horizon_args()) == 8
    # a reference model on 3 ranks: kept / 1 micro-batches must split over 2 and 3 ranks: lcm(8, 6) = 24
    args = horizon_args(algo__kl__init_coef=0.01, ref__num_gpus_per_node=3)
    assert kept_count_unit(args) == 24
    # a critic on 4 ranks and micro-batches of 2: lcm(8, 2 x lcm(2, 4)) = 8
    args = horizon_args(critic__model_name_or_path="critic", critic__num_gpus_per_node=4, rollout__micro_batch_size=2)
    assert kept_count_unit(args) == 8
    # with a KL coefficient of 0 the reference model does not exist
    assert kept_count_unit(horizon_args(ref__num_gpus_per_node=3)) == 8
