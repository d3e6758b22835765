"""The D3S trainers as Ray actors, built the way ``openrlhf.cli.train_ppo_ray`` builds OpenRLHF's.

``D3SPPOTrainer.remote(...)`` and ``D3SPPOTrainerAsync.remote(...)`` run the real upstream constructors
(tokenizer, prompt dataset and dataloader, SamplesGenerator; for async the generator and training actors, the
queues and the vLLM lock) in Ray workers, with a tiny local tokenizer and prompt file. The model groups are not
needed for construction and are None. The step logic itself is tested in test_integration_experience_maker.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import ray
from openrlhf.utils import get_strategy

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.cpu import runtime
from d3s_openrlhf.integration.actor import D3SPolicyModelActor
from d3s_openrlhf.integration.eval_metrics import PassAtKGenerateSamplesActor, PassAtKPPOTrainer, PassAtKPPOTrainerAsync
from d3s_openrlhf.integration.host import config_from_args, config_namespace, parse_host_args, scaled_max_steps
from d3s_openrlhf.integration.trainer import (
    D3SGenerateSamplesActor,
    D3SPPOTrainer,
    D3SPPOTrainerAsync,
    D3STrainingActor,
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
    runtime.init_local_ray(num_cpus=8, include_dashboard=False, object_store_memory=150 * 1024**2)
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


def _generator_class():
    """A function run inside a trainer or generator actor: the class of its samples generator."""

    def generator_class(actor):
        return type(actor.samples_generator).__name__

    return generator_class


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
    "actor_class",
    [
        D3SPolicyModelActor,
        D3SPPOTrainer,
        D3SPPOTrainerAsync,
        D3STrainingActor,
        D3SGenerateSamplesActor,
        PassAtKPPOTrainer,
        PassAtKPPOTrainerAsync,
        PassAtKGenerateSamplesActor,
    ],
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
    assert ray.get(trainer.__ray_call__.remote(_generator_class())) == "D3SSamplesGenerator"
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
    generator_class = _generator_class()

    def inside(wrapper):
        import openrlhf.trainer.ppo_trainer_async as module

        broken = check_super(wrapper)
        for actor in (wrapper.trainer_actor, wrapper.generator_actor):
            broken += ray.get(actor.__ray_call__.remote(check_super))
        assert not broken, broken
        training = ray.get(wrapper.trainer_actor.__ray_call__.remote(inspect))
        steps = ray.get(wrapper.generator_actor.d3s_rollout_steps.remote())
        generator = ray.get(wrapper.generator_actor.__ray_call__.remote(generator_class))
        globals_now = (
            module.TrainingActor.__ray_actor_class__.__name__,
            module.GenerateSamplesActor.__ray_actor_class__.__name__,
        )
        return training, steps, generator, globals_now

    training, steps, generator, globals_now = ray.get(trainer.__ray_call__.remote(inside))
    assert training == ("_D3STrainingActor", "D3SExperienceMaker", 6)
    assert generator == "D3SSamplesGenerator"
    assert steps == 6
    # PPOTrainerAsync.get_max_steps asks the generator actor: the same rescaled horizon as the sync trainer
    assert ray.get(trainer.get_max_steps.remote()) == scaled_max_steps(
        strategy.args, config_from_args(strategy.args), 20, 6
    )
    # In the wrapper's worker the module globals were swapped only for the duration of its constructor.
    assert globals_now == ("TrainingActor", "GenerateSamplesActor")
    ray.kill(trainer)


@pytest.mark.parametrize("async_enable", [False, True], ids=["sync", "async"])
def test_d3s_off_trainers_build_the_generator_that_asks_for_the_engines_logprobs_under_lora(run_files, async_enable):
    model, prompts = run_files
    flags = ["--ds.lora.rank", "8", *(["--train.async_enable"] if async_enable else [])]
    trainer_class = PassAtKPPOTrainerAsync if async_enable else PassAtKPPOTrainer
    trainer = trainer_class.remote(model, _strategy(model, prompts, *flags), None, None, None, None, None, max_len=64)
    generator_class = _generator_class()

    def inside(wrapper):
        return ray.get(wrapper.generator_actor.__ray_call__.remote(generator_class))

    inspect = inside if async_enable else generator_class
    assert ray.get(trainer.__ray_call__.remote(inspect)) == "EngineLogprobsSamplesGenerator"
    ray.kill(trainer)
