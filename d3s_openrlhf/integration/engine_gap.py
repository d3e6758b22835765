"""During LoRA training, how far the engine that samples is from the trainer that learns: ``lora/engine_gap``.

Under LoRA the weight sync sends merged weights in the weights' dtype (``integration/lora_sync.py``), and the engine
computes with kernels of its own: its policy is close to the trainer's, never equal, and a sync that went wrong
(an adapter lost, a layer not sent) shows only as rollouts that are quietly off-policy. Upstream measures the gap
only with its importance-sampling correction on (``--algo.advantage.is_correction_level``: ``vllm_kl``), which
changes the loss. When ``host.engine_gap_logged`` (LoRA, no agent function) the entrypoint measures it without
touching the loss:

* :func:`engines_reporting_logprobs`: the engines are created with ``logprobs_mode="processed_logprobs"``, the
  log-probs of the distribution they sample from (temperature applied, as in the trainer's forward; under top-p or
  top-k renormalised over the tokens kept, which the trainer's are not), as upstream creates them for its
  correction;
* :class:`EngineLogprobsSamplesGenerator`: each request asks for the sampled token's log-prob
  (``SamplingParams(logprobs=1)``); upstream keeps them as ``experience.rollout_log_probs``, which its loss reads
  only with the correction on;
* :class:`EngineGapMetric`: each training micro-batch logs ``lora/engine_gap``, the token mean of
  |log pi_trainer - log pi_engine| over its generated tokens (``core.metrics.logprob_gap``), the trainer's side being
  the experience's ``action_log_probs``: its forward before the update. A 0-d value, which upstream weighs by tokens
  across micro-batches and ranks (``train/lora/engine_gap`` in wandb and tensorboard).

The engine sampled with the weights of the trainer's forward unless a sync came in between: in async training,
for samples served from upstream's sample buffer (``--rollout.vllm_generate_batch_size`` > ``--rollout.batch_size``)
and with partial rollouts, the gap holds that lag too.

Cost: the engines compute the processed log-probs (a float32 log-softmax over the vocabulary) at every decode step,
and on CUDA sample top-k / top-p without FlashInfer's kernel.
"""

from __future__ import annotations

import functools
import inspect

from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from vllm import SamplingParams

from d3s_openrlhf.core.metrics import logprob_gap
from d3s_openrlhf.integration.host import engine_gap_logged
from d3s_openrlhf.integration.seams import swapped_globals

ENGINE_GAP = "lora/engine_gap"
LOGPROBS_MODE = "processed_logprobs"


def engines_reporting_logprobs(create_vllm_engines):
    """Upstream's ``create_vllm_engines``, whose engines report the processed log-probs of what they sample (unless
    the caller chose a ``logprobs_mode``)."""
    signature = inspect.signature(create_vllm_engines)

    @functools.wraps(create_vllm_engines)
    def create(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("logprobs_mode") is None:
            bound.arguments["logprobs_mode"] = LOGPROBS_MODE
        return create_vllm_engines(*bound.args, **bound.kwargs)

    return create


def _sampling_params_with_logprob(**kwargs) -> SamplingParams:
    """vLLM's ``SamplingParams``, asking for each sampled token's log-prob unless the caller asked for more."""
    if kwargs.get("logprobs") is None:
        kwargs["logprobs"] = 1
    return SamplingParams(**kwargs)


class EngineLogprobsSamplesGenerator(SamplesGenerator):
    """Upstream's samples generator; under LoRA its requests ask the engines for each sampled token's log-prob."""

    def _dispatch_prompts_to_vllm(self, *args, **kwargs):
        if not engine_gap_logged(self.args):
            return super()._dispatch_prompts_to_vllm(*args, **kwargs)
        with swapped_globals(SamplesGenerator._dispatch_prompts_to_vllm, SamplingParams=_sampling_params_with_logprob):
            return super()._dispatch_prompts_to_vllm(*args, **kwargs)


class EngineGapMetric:
    """Mixin for ``ActorPPOTrainer``: under LoRA, each training micro-batch that carries the engine's log-probs logs
    ``lora/engine_gap`` (module docstring)."""

    def training_step(self, experience, *args, **kwargs):
        if engine_gap_logged(self.args) and experience.rollout_log_probs is not None:
            experience.info[ENGINE_GAP] = logprob_gap(
                experience.action_log_probs, experience.rollout_log_probs, experience.action_mask
            )
        return super().training_step(experience, *args, **kwargs)
