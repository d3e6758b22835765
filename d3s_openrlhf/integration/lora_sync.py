"""LoRA through vLLM: the engines serve the trainer's adapter as an adapter (the trainer side of the sync).

OpenRLHF 0.11.2's ``ActorPPOTrainer.broadcast_to_vllm`` sends ``named_parameters()`` of the model it trains. Under
``--ds.lora.rank > 0`` that model is a PEFT wrapper: the names carry ``base_model.model.`` and ``.base_layer``, the
adapter's ``lora_A`` / ``lora_B`` tensors come along, and vLLM's ``load_weights`` fails at the first sync ("There
is no module or parameter named 'base_model'"; upstream issues #991 and #1081). Upstream generates only with vLLM,
so LoRA cannot run there at all.

:class:`AdapterLoRASync` sends the adapter itself: the ``lora_A`` / ``lora_B`` factors of every LoRA layer under
PEFT's checkpoint names, and the adapter's PEFT config, to every engine, which installs them as its vLLM LoRA
adapter (:mod:`d3s_openrlhf.integration.lora_engine`). vLLM adds the adapter's output to the base layer's, as the
trainer's forward does. Merging ``W + scale * B @ A`` into bf16 weights instead rounds away every entry of the
update under half a bf16 step of W: at an update of std 1e-5 (B from 0, RL learning rates), the share of its effect
on the trainer's log-probs that reached the engine was 0.04 merged, 1.00 as an adapter (benchmarks/RESULTS.md
section 8).

The factors travel through Ray's object store (rank 0 puts them once for all engines), not the weight-sync group:
an adapter is small (rank 16 on a 7B model: ~40 MB in bf16). Under ZeRO-3 each layer's factors are gathered by
themselves on every rank. Everything else that trains (e.g. ``modules_to_save``) and, under ``--ds.load_in_4bit``
at the first sync, the dequantized base weights of the adapted layers (the engine loaded the checkpoint's, the
trainer's base is the quantized one) go through upstream's own ``broadcast_to_vllm``, after the install: its
prefix-cache reset then also drops what was cached under the previous adapter, its barrier closes the sync.

The engines return every sampled token's log-prob (``lora_engine``): the trainer logs how far they are from its
own, ``lora/engine_gap`` (:meth:`AdapterLoRASync.training_step`).

With LoRA off the sync and the training step are upstream's, unchanged.
"""

from __future__ import annotations

import contextlib
import json
import types
from typing import List, Optional, Tuple

import ray
import torch
from openrlhf.models.utils import masked_mean
from openrlhf.trainer.ray import ppo_actor
from peft.tuners.lora import LoraLayer
from peft.utils.integrations import dequantize_module_weight

from d3s_openrlhf.integration.seams import swapped_globals

PEFT_PREFIX = "base_model.model."


def lora_layers(model: torch.nn.Module) -> List[Tuple[str, LoraLayer]]:
    """(module name, layer) of every LoRA layer of ``model``; empty when it carries no LoRA."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def base_name(peft_name: str) -> str:
    """The name the base model (and vLLM) gives a parameter or module of its PEFT wrapper."""
    name = peft_name[len(PEFT_PREFIX) :] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(".base_layer", "")


def lora_variant(layer: LoraLayer, adapter: str) -> Optional[str]:
    """The name of the LoRA variant ``adapter`` takes on ``layer`` (DoRA, ...), or None for plain LoRA: the variant
    object of PEFT >= 0.16 (``layer.lora_variant``), else the DoRA flag of every PEFT with DoRA (0.9 on:
    ``layer.use_dora``, which later versions still fill). OpenRLHF's ``--ds.lora.*`` flags build plain LoRA; a
    variant comes from a LoRA config built elsewhere."""
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is not None:
        return type(variant).__name__
    return "DoRA" if getattr(layer, "use_dora", {}).get(adapter) else None


def _refuse_tied_embedding_adapters(model: torch.nn.Module, layers) -> None:
    """vLLM ties the LM head to the input embedding (one tensor); an adapter on either one changes one side only."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    tied = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    adapted = [name for name, layer in layers if id(layer) in tied]
    if adapted:
        raise ValueError(
            f"LoRA adapters on {', '.join(adapted)}, which the model ties to its "
            f"{'LM head' if 'embed' in adapted[0] else 'input embedding'} (tie_word_embeddings): vLLM holds one tensor "
            "for both, so the adapted policy cannot be synced; leave them out of --ds.lora.target_modules "
            "(the default all-linear does)"
        )


def _gathered(params: List[torch.nn.Parameter]):
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params)
    return contextlib.nullcontext()


def _as_synced(name: str, tensor: torch.Tensor) -> Tuple[str, torch.Tensor]:
    # upstream reads ``ds_shape`` for the shape under ZeRO-3; a dequantized copy is whole, its shape is its own
    tensor.ds_shape = tensor.shape
    return name, tensor


class AdapterLoRASync:
    """Mixin for ``ActorPPOTrainer``: under LoRA, ``broadcast_to_vllm`` installs the trainer's adapter in the
    engines (module docstring)."""

    def broadcast_to_vllm(self):
        model = self.actor.model.module
        layers = lora_layers(model)
        if not layers:
            return super().broadcast_to_vllm()
        _refuse_tied_embedding_adapters(model, layers)
        adapter = active_adapter(model, layers)
        tensors = {}
        for name, layer in layers:
            factors = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
            with _gathered(list(factors)):
                tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = (
                    f.detach().to("cpu", copy=True) for f in factors
                )
        in_layers = {id(p) for _, layer in layers for p in layer.parameters()}
        # e.g. modules_to_save: real parameters, which upstream's loop gathers one at a time under ZeRO-3
        others = [(base_name(n), p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_layers]
        if not getattr(self, "_d3s_base_synced", False):
            others = _quantized_base_weights(layers) + others
            self._d3s_base_synced = True
        if torch.distributed.get_rank() == 0:
            config = peft_config_fields(model.peft_config[adapter])
            payload = ray.put(tensors)
            ray.get([engine.load_lora_adapter.remote(payload, config) for engine in self.vllm_engines])
        self._upstream_sync(others)

    def training_step(self, experience, *args, **kwargs):
        """Upstream's, logging under LoRA ``lora/engine_gap``: the mean over generated tokens of
        ``|log p_engine(a) - log p_trainer(a)|``, the engine's log-prob of each sampled token (``rollout_log_probs``)
        against the trainer's at the same weights (``action_log_probs``): 0 for an engine that samples the
        trainer's policy, up to kernel rounding."""
        if self.args.ds.lora.rank > 0 and experience.rollout_log_probs is not None:
            gap = (experience.rollout_log_probs - experience.action_log_probs).abs()
            experience.info["lora/engine_gap"] = masked_mean(gap, experience.action_mask)
        return super().training_step(experience, *args, **kwargs)

    def _upstream_sync(self, weights: List[Tuple[str, torch.Tensor]]) -> None:
        """Upstream's ``broadcast_to_vllm`` with ``weights`` as the named parameters of the model it reads."""
        actor = self.actor
        # upstream reads self.actor.model.module.named_parameters() and, for vision-language models, is_vlm
        self.actor = types.SimpleNamespace(
            model=types.SimpleNamespace(module=types.SimpleNamespace(named_parameters=lambda: iter(weights))),
            is_vlm=False,  # the weights are chosen here; upstream's VLM filter keeps trainable ones only
        )
        try:
            super().broadcast_to_vllm()
        finally:
            self.actor = actor


def active_adapter(model: torch.nn.Module, layers) -> str:
    """The one adapter the run trains (OpenRLHF builds one, ``default``); raises for a LoRA variant (DoRA, ...),
    for adapters on embeddings and for several active adapters, which vLLM cannot serve as this one."""
    adapters = sorted({a for _, layer in layers for a in layer.active_adapters})
    if len(adapters) != 1:
        raise NotImplementedError(f"active LoRA adapters {adapters}: the LoRA sync serves one adapter in vLLM")
    (adapter,) = adapters
    for name, layer in layers:
        variant = lora_variant(layer, adapter)
        if variant is not None:  # vLLM serves plain LoRA (W x + scale * B A x); DoRA rescales each column
            raise NotImplementedError(
                f"adapter {adapter!r} is a LoRA variant ({variant}): vLLM serves plain LoRA only; train plain LoRA "
                "(a LoRA config without use_dora), as OpenRLHF's --ds.lora.* flags build it"
            )
        if adapter not in layer.lora_A:
            raise NotImplementedError(
                f"a LoRA adapter on the embedding {base_name(name)}: the LoRA sync serves adapters on linear layers; "
                "leave it out of --ds.lora.target_modules (the default all-linear does)"
            )
    return adapter


def peft_config_fields(config) -> dict:
    """``config`` (a PEFT ``LoraConfig``) as the fields of its ``adapter_config.json``."""
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def _quantized_base_weights(layers) -> List[Tuple[str, torch.Tensor]]:
    """The dequantized base weights of the adapted layers that the trainer holds quantized (--ds.load_in_4bit)."""
    weights = []
    for name, layer in layers:
        base = layer.get_base_layer()
        if _is_quantized(base):
            with _gathered(list(base.parameters())):
                weights.append(_as_synced(base_name(name) + ".weight", dequantize_module_weight(base).detach().clone()))
    return weights


def _is_quantized(module: torch.nn.Module) -> bool:
    return type(module.weight).__name__ == "Params4bit" or hasattr(module.weight, "quant_state")


class LoRASyncActorPPOTrainer(AdapterLoRASync, ppo_actor.ActorPPOTrainer):
    """Upstream's actor trainer with the LoRA adapter sync."""


@ray.remote(num_gpus=1)
class LoRASyncPolicyModelActor(ppo_actor.PolicyModelActor.__ray_actor_class__):
    """Upstream's policy actor with :class:`LoRASyncActorPPOTrainer`: what the entrypoint runs under LoRA with D3S
    off."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        upstream = super().init_model_from_pretrained
        with swapped_globals(upstream.__func__, ActorPPOTrainer=LoRASyncActorPPOTrainer):
            upstream(strategy, pretrain, max_steps, vllm_engines)
