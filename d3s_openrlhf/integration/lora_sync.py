"""LoRA through vLLM: the actor's weight sync sends the merged weights under the base model's names.

OpenRLHF 0.11.2's ``ActorPPOTrainer.broadcast_to_vllm`` sends ``named_parameters()`` of the model it trains. Under
``--ds.lora.rank > 0`` that model is a PEFT wrapper: the names carry ``base_model.model.`` and ``.base_layer``, the
adapter's ``lora_A`` / ``lora_B`` tensors come along, and vLLM's ``load_weights`` fails at the first sync ("There
is no module or parameter named 'base_model'"; upstream issues #991 and #1081). Upstream generates only with vLLM,
so LoRA cannot run there at all.

:class:`MergedLoRASync` sends instead, for each LoRA layer, its merged weight ``W + sum over active adapters of
scale * B @ A`` (``scale = alpha / rank``; dropout applies to the layer's input, never to the weights) under the
base layer's name (``model.layers.0.self_attn.q_proj.weight``), plus any other parameter that trains. Frozen base
weights outside the LoRA layers never change, and the engine loaded them from the same checkpoint, so they are not
sent: the sync moves the adapted layers only, less than upstream's full sync. Adapter tensors are not sent.

The transport is upstream's own (NCCL or gloo broadcast, Ray collective, CUDA IPC under colocation, the prefix
cache reset): upstream's ``broadcast_to_vllm`` runs once per bucket of merged weights, with the trainer's actor
standing in as a model whose parameters are that bucket. A bucket holds at most :data:`BUCKET_BYTES` of merged
weights (a layer larger than that goes alone). Under ZeRO-3 each layer's parameters are gathered by themselves,
merged and released before the next, so the sync holds one layer whole at a time plus one bucket of merged copies.
The deltas are summed onto W in fp32 and cast back to W's dtype. In bf16 that cast rounds away the entries of a
small update under half a bf16 step of W; the trainer's own forward, which adds the adapter's output to the base
layer's bf16 output, loses as much, and an engine serving the adapter itself followed the trainer no closer while
generating slower (benchmarks/RESULTS.md, section 8).

A sync still costs what one upstream sync costs: what upstream's method does once per call is done once per sync
(:func:`_bucket_of_a_sync`): the prefix-cache reset (in the last bucket's call, so no cache block computed from
half-synced weights survives), ``torch.cuda.empty_cache`` at the start (first call) and at the end (last call),
the closing barrier (last call), and the engines' end-of-sync signal (``empty_cache`` on the last weight). The
per-weight work (one ``update_weight`` and broadcast each, and under CUDA IPC a barrier each) is upstream's own.

With LoRA off the sync is upstream's, unchanged.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import List, Optional, Tuple

import ray
import torch
from openrlhf.trainer.ray import ppo_actor
from peft.tuners.lora import LoraLayer
from peft.utils.integrations import dequantize_module_weight

from d3s_openrlhf.integration.engine_gap import EngineGapMetric
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


def merged_weight(layer: LoraLayer) -> torch.Tensor:
    """``W + sum_a scale_a * B_a @ A_a`` over the layer's active adapters (each delta from PEFT's own
    ``get_delta_weight``, in the adapter's dtype), summed in fp32 and cast to the dtype of W (dequantized under
    ``--ds.load_in_4bit``: the engine's dtype). The layer's parameters must be whole (gathered under ZeRO-3)."""
    weight = dequantize_module_weight(layer.get_base_layer())  # the weight itself unless it is quantized
    merged = weight.detach().to(torch.float32, copy=True)  # a copy: a gathered weight is released after
    if not layer.merged:  # a merged layer's base weight already holds its adapters
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A and adapter not in getattr(layer, "lora_embedding_A", {}):
                continue
            variant = lora_variant(layer, adapter)
            if variant is not None:  # its weight is not W + scale * B @ A (DoRA rescales each column)
                raise NotImplementedError(
                    f"adapter {adapter!r} is a LoRA variant ({variant}): the merged weight sync sends "
                    "W + scale * B @ A only; train plain LoRA (a LoRA config without use_dora), as OpenRLHF's "
                    "--ds.lora.* flags build it"
                )
            merged.add_(layer.get_delta_weight(adapter).detach().float())
    return merged.to(weight.dtype)


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
    # upstream reads ``ds_shape`` for the shape under ZeRO-3; a merged weight is whole, its shape is its own
    tensor.ds_shape = tensor.shape
    return name, tensor


# A bucket's merged copies are what a sync holds beyond the training state (besides one gathered layer). The
# transport sends one tensor at a time whatever the bucket, so a larger bucket buys only fewer calls into
# upstream's method (under a millisecond each here, benchmarks/SUPERSEDED.md); 256 MiB keeps the sync's
# extra memory, with the largest adapted layer of a 7B model (an MLP projection, 136 MiB in bf16), below the
# 1 GiB input embedding that upstream's own full sync of such a model gathers whole.
BUCKET_BYTES = 256 * 2**20


class MergedLoRASync:
    """Mixin for ``ActorPPOTrainer``: under LoRA, ``broadcast_to_vllm`` syncs merged weights (module docstring)."""

    def broadcast_to_vllm(self):
        model = self.actor.model.module
        layers = lora_layers(model)
        if not layers:
            return super().broadcast_to_vllm()
        _refuse_tied_embedding_adapters(model, layers)
        in_layers = {id(p) for _, layer in layers for p in layer.parameters()}
        # e.g. modules_to_save: real parameters, which upstream's loop gathers one at a time under ZeRO-3
        trainable = [
            (base_name(n), p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_layers
        ]
        bucket, size, first = [], 0, True
        for name, layer in layers:
            with _gathered(list(layer.parameters())):
                weight = merged_weight(layer)
            nbytes = weight.numel() * weight.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                self._upstream_sync(bucket, first, last=False)
                bucket, size, first = [], 0, False
            bucket.append(_as_synced(base_name(name) + ".weight", weight))
            size += nbytes
            del weight
        self._upstream_sync(bucket + trainable, first, last=True)

    def _upstream_sync(self, weights: List[Tuple[str, torch.Tensor]], first: bool, last: bool) -> None:
        """Upstream's ``broadcast_to_vllm`` with ``weights`` as the named parameters of the model it reads, as the
        ``first`` and / or ``last`` call of a sync (:func:`_bucket_of_a_sync`)."""
        actor, engines, strategy = self.actor, self.vllm_engines, self.strategy
        # upstream reads self.actor.model.module.named_parameters() and, for vision-language models, is_vlm
        self.actor = types.SimpleNamespace(
            model=types.SimpleNamespace(module=types.SimpleNamespace(named_parameters=lambda: iter(weights))),
            is_vlm=False,  # the weights are chosen here; upstream's VLM filter keeps trainable ones only
        )
        if not last:
            if engines is not None:
                self.vllm_engines = [_MidSync(engine) for engine in engines]
            self.strategy = _without_prefix_cache_reset(strategy)
        upstream = super().broadcast_to_vllm
        try:
            with _bucket_of_a_sync(upstream.__func__, first, last):
                upstream()
        finally:
            self.actor, self.vllm_engines, self.strategy = actor, engines, strategy


def _without_prefix_cache_reset(strategy):
    """The strategy as upstream's ``broadcast_to_vllm`` reads it (``strategy.args``), with prefix caching off: the
    call resets no cache."""
    args = strategy.args
    vllm = types.SimpleNamespace(**{**vars(args.vllm), "enable_prefix_caching": False})
    return types.SimpleNamespace(args=types.SimpleNamespace(**{**vars(args), "vllm": vllm}))


@contextlib.contextmanager
def _bucket_of_a_sync(upstream, first: bool, last: bool):
    """Upstream's ``broadcast_to_vllm`` (the function ``upstream``) as one call of a sync made of several: its
    opening ``torch.cuda.empty_cache`` only in the ``first`` call, its closing one and its closing barrier only in
    the ``last``. The barriers CUDA IPC takes after each weight (from a helper of the method) are kept."""
    empty_cache, barrier = torch.cuda.empty_cache, upstream.__globals__["torch_dist_barrier_and_cuda_sync"]
    opening = [True]

    def sync_empty_cache():
        keep = first if opening[0] else last
        opening[0] = False
        if keep:
            empty_cache()

    def sync_barrier():
        closing = sys._getframe(1).f_code.co_name == upstream.__name__
        if last or not closing:
            barrier()

    with swapped_globals(torch.cuda, empty_cache=sync_empty_cache):
        with swapped_globals(upstream, torch_dist_barrier_and_cuda_sync=sync_barrier):
            yield


class _MidSync:
    """An engine handle whose weight updates never say the sync ends (``empty_cache=False``): an engine that acts
    at the end of a sync (the CPU runtime's reloads its weights then) acts once per sync, not once per bucket."""

    _WEIGHT_UPDATES = ("update_weight", "update_weight_cuda_ipc")

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):  # the weight updates, and reset_prefix_cache etc. as they are
        attribute = getattr(self._engine, name)
        return _MidSyncMethod(attribute) if name in self._WEIGHT_UPDATES else attribute


class _MidSyncMethod:
    def __init__(self, method) -> None:
        self._method = method

    def remote(self, *args, **kwargs):
        return self._method.remote(*args, **dict(kwargs, empty_cache=False))


class LoRASyncActorPPOTrainer(EngineGapMetric, MergedLoRASync, ppo_actor.ActorPPOTrainer):
    """Upstream's actor trainer with the merged LoRA weight sync and the engine's gap (``integration.engine_gap``)."""


@ray.remote(num_gpus=1)
class LoRASyncPolicyModelActor(ppo_actor.PolicyModelActor.__ray_actor_class__):
    """Upstream's policy actor with :class:`LoRASyncActorPPOTrainer`: what the entrypoint runs under LoRA with D3S
    off."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        upstream = super().init_model_from_pretrained
        with swapped_globals(upstream.__func__, ActorPPOTrainer=LoRASyncActorPPOTrainer):
            upstream(strategy, pretrain, max_steps, vllm_engines)
