"""integration/engine_gap.py: under LoRA the engines report the log-probs of what they sample, the requests ask for
them, and the actor trainer logs the gap (its ``ppo_train`` on the real class: tests/integration/
test_integration_actor.py; the trainers' generator classes: test_integration_trainer.py; whole runs:
tests/e2e/test_e2e_lora.py)."""

import inspect
from types import SimpleNamespace as NS

import openrlhf.trainer.ppo_utils.samples_generator as upstream_generator
import openrlhf.trainer.ray as trainer_ray
import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from vllm import SamplingParams

from d3s_openrlhf.integration import engine_gap, host
from d3s_openrlhf.integration.host import parse_host_args

UPSTREAM_CALL = [1, 1, "model", 0, False, True, False, 64, None, 0.9, False]  # train_ppo_ray's positional arguments


def recorder(calls):
    def create_vllm_engines(*args, **kwargs):
        calls.append(inspect.signature(trainer_ray.create_vllm_engines).bind(*args, **kwargs).arguments)
        return ["engine"]

    create_vllm_engines.__signature__ = inspect.signature(trainer_ray.create_vllm_engines)
    return create_vllm_engines


@pytest.mark.parametrize("asked, expected", [(None, engine_gap.LOGPROBS_MODE), ("raw_logprobs", "raw_logprobs")])
def test_the_engines_report_processed_logprobs_unless_the_caller_chose_a_mode(asked, expected):
    calls = []
    create = engine_gap.engines_reporting_logprobs(recorder(calls))
    assert create(*UPSTREAM_CALL, asked, agent_func_path=None) == ["engine"]
    assert calls[0]["logprobs_mode"] == expected
    assert calls[0]["max_model_len"] == 64 and calls[0]["gpu_memory_utilization"] == 0.9
    create(*UPSTREAM_CALL)  # logprobs_mode not given at all
    assert calls[1]["logprobs_mode"] == engine_gap.LOGPROBS_MODE


class Engine:
    """A stand-in rollout actor recording the sampling parameters of each request."""

    def __init__(self):
        self.requests = []
        self.get_num_unfinished_requests = NS(remote=lambda: 0)
        self.generate_responses = NS(remote=lambda **request: self.requests.append(request["sampling_params"]))


AGENT = ["--train.agent_func_path", "agent.py"]


@pytest.mark.parametrize(
    "flags, logged", [(["--ds.lora.rank", "8"], True), (["--ds.lora.rank", "8", *AGENT], False), ([], False)]
)
def test_the_gap_is_logged_under_lora_without_an_agent(flags, logged):
    assert host.engine_gap_logged(parse_host_args(flags)) is logged


@pytest.mark.parametrize("flags", [["--ds.lora.rank", "8"], ["--ds.lora.rank", "8", *AGENT], []], ids=str)
@pytest.mark.parametrize("correction", ["off", "token"])
def test_when_the_gap_is_logged_each_request_asks_for_the_sampled_tokens_logprob(monkeypatch, flags, correction):
    monkeypatch.setattr(upstream_generator, "ray", NS(get=lambda refs: refs))  # the engines' counts, as they are
    args = parse_host_args([*flags, "--algo.advantage.is_correction_level", correction])
    engine = Engine()
    generator = engine_gap.EngineLogprobsSamplesGenerator(NS(args=args), [], [], tokenizer=None, vllm_engines=[engine])
    generator._dispatch_prompts_to_vllm(["a", "b"], ["1", "2"], temperature=0.7, max_new_tokens=5)
    upstream = 1 if correction != "off" else None
    expected = 1 if host.engine_gap_logged(args) else upstream
    assert [params.logprobs for params in engine.requests] == [expected] * 2
    assert {(params.temperature, params.max_tokens) for params in engine.requests} == {(0.7, 5)}
    assert upstream_generator.SamplingParams is SamplingParams  # restored


class Recorded:
    def training_step(self, experience, *args, **kwargs):
        return dict(experience.info)


class GapTrainer(engine_gap.EngineGapMetric, Recorded):
    def __init__(self, *flags):
        self.args = parse_host_args(list(flags))


def experience(rollout_log_probs):
    action_mask = torch.tensor([[True, True, False]])
    return Experience(
        action_log_probs=torch.tensor([[-1.0, -2.0, -3.0]]),
        rollout_log_probs=rollout_log_probs,
        action_mask=action_mask,
        info={},
    )


def test_a_training_step_logs_the_gap_when_it_is_logged_and_the_engine_reported_logprobs():
    engine, lora = torch.tensor([[-1.5, -1.0, 0.0]]), ("--ds.lora.rank", "8")
    assert GapTrainer(*lora).training_step(experience(engine), 0.0, 0)[engine_gap.ENGINE_GAP] == pytest.approx(0.75)
    assert engine_gap.ENGINE_GAP not in GapTrainer(*lora).training_step(experience(None), 0.0, 0)
    assert engine_gap.ENGINE_GAP not in GapTrainer(*lora, *AGENT).training_step(experience(engine), 0.0, 0)
    assert engine_gap.ENGINE_GAP not in GapTrainer().training_step(experience(engine), 0.0, 0)
