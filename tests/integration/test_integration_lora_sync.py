"""The merged LoRA weight sync around upstream's real ``ActorPPOTrainer.broadcast_to_vllm``.

Real: a PEFT LoRA model on a tiny Llama (tied embeddings, as the toy and small Qwen2 models), upstream's
``broadcast_to_vllm`` (its broadcast transport, run once per bucket), a one-rank gloo group for its barrier.
Stand-ins: the vLLM engines (they record ``update_weight`` calls) and the model-update group (it records what is
broadcast); PEFT's own ``merge_and_unload`` is the reference for the merged weights.
"""

import contextlib
import copy
from types import SimpleNamespace as NS

import openrlhf.trainer.ray.ppo_actor as ppo_actor
import pytest
import torch

peft = pytest.importorskip("peft")

from d3s_openrlhf.integration import lora_sync  # noqa: E402
from d3s_openrlhf.integration.actor import D3SActorPPOTrainer  # noqa: E402
from d3s_openrlhf.integration.lora_sync import (  # noqa: E402
    LoRASyncActorPPOTrainer,
    base_name,
    lora_layers,
    lora_variant,
)

VOCAB = 96


def tiny_llama(seed=0, dtype=torch.float32, tied=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


def with_lora(model, target_modules="all-linear", dropout=0.3, use_dora=False):
    config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=4,
        lora_alpha=16,
        target_modules=target_modules,
        lora_dropout=dropout,
        use_dora=use_dora,
    )
    model = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    for _, layer in lora_layers(model):
        # one factor starts at 0 (a no-op adapter): give both trained-looking values
        for name, param in layer.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.1)
    return model


class Recorder:
    """The vLLM engines and the model-update group of a broadcast sync: what reaches the engines, by name."""

    def __init__(self):
        self.calls, self.received, self.ends, self.resets = [], {}, [], 0
        self.update_weight = NS(remote=self._update_weight)
        self.reset_prefix_cache = NS(remote=self._reset_prefix_cache)

    def _reset_prefix_cache(self):
        self.resets += 1

    def _update_weight(self, name, dtype, shape, empty_cache):
        self.calls.append((name, dtype, tuple(shape)))
        self.ends.append(empty_cache)
        return name

    def broadcast(self, tensor, src, stream=None):
        name, dtype, shape = self.calls[-1]
        assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape), name
        self.received[name] = tensor.detach().clone()


def trainer_for(model, cls, monkeypatch, zero_stage=2, prefix_caching=False):
    """A trainer with what ``broadcast_to_vllm`` reads (its __init__ builds optimizers and a replay buffer); the
    recorder also counts the sync's ``torch.cuda.empty_cache`` calls and barriers (``.costs``)."""
    costs = {"empty_cache": 0, "barrier": 0}

    def count(key, call=None):
        def spy(*args, **kwargs):
            costs[key] += 1
            return call(*args, **kwargs) if call else None

        return spy

    monkeypatch.setattr(torch.cuda, "empty_cache", count("empty_cache"))
    barrier = ppo_actor.torch_dist_barrier_and_cuda_sync
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", count("barrier", barrier))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(ppo_actor, "ray", NS(get=lambda refs: refs))  # the stand-in engines answer at once
    recorder = Recorder()
    recorder.costs = costs
    trainer = object.__new__(cls)
    trainer.actor = NS(model=NS(module=model), is_vlm=False)
    trainer.strategy = NS(
        args=NS(
            ds=NS(zero_stage=zero_stage, tensor_parallel_size=1),
            vllm=NS(enable_prefix_caching=prefix_caching, sync_with_ray=False),
        )
    )
    trainer.vllm_engines = [recorder]
    trainer._model_update_group = recorder
    trainer.use_cuda_ipc = False
    return trainer, recorder


@pytest.mark.parametrize("cls", [LoRASyncActorPPOTrainer, D3SActorPPOTrainer])
@pytest.mark.parametrize(
    "target_modules, tied", [("all-linear", True), (["q_proj", "v_proj", "embed_tokens", "lm_head"], False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_receive_the_merged_weights_under_base_names(
    cls, target_modules, tied, dtype, process_group, monkeypatch
):
    model = with_lora(tiny_llama(dtype=dtype, tied=tied), target_modules)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()  # PEFT's own merge
    trainer, recorder = trainer_for(model, cls, monkeypatch)
    trainer.actor.model.module.train()  # dropout on: it must not reach the weights

    trainer.broadcast_to_vllm()

    layers = [base_name(name) + ".weight" for name, _ in lora_layers(model)]
    assert list(recorder.received) == layers  # the adapted layers alone, frozen weights are already in the engine
    assert recorder.ends == [False] * (len(layers) - 1) + [True]  # one end of sync, as upstream's single loop
    assert not any("lora_" in name or "base_model" in name or "base_layer" in name for name in recorder.received)
    tolerance = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for name, tensor in recorder.received.items():
        assert tensor.dtype == dtype
        torch.testing.assert_close(tensor.float(), reference[name].float(), **tolerance)
        assert not torch.equal(tensor, model.get_parameter(PEFT_BASE(name)).detach())  # the adapter is in it


def PEFT_BASE(name):
    module, _, leaf = name.rpartition(".")
    return f"base_model.model.{module}.base_layer.{leaf}"


def test_a_model_loaded_with_the_synced_weights_computes_the_adapted_policy(process_group, monkeypatch):
    model = with_lora(tiny_llama())
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()

    engine_model = tiny_llama()  # what the engine loaded from the checkpoint, then the synced weights
    engine_model.load_state_dict(recorder.received, strict=False)
    tokens = torch.randint(0, VOCAB, (3, 7))
    model.eval()
    torch.testing.assert_close(engine_model(tokens).logits, model(input_ids=tokens).logits, atol=1e-5, rtol=1e-5)


def test_without_lora_the_sync_is_upstreams(process_group, monkeypatch):
    model = tiny_llama()
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()
    assert list(recorder.received) == [name for name, _ in model.named_parameters()]
    assert recorder.ends == [False] * (len(recorder.ends) - 1) + [True]
    for name, param in model.named_parameters():
        assert torch.equal(recorder.received[name], param.detach())


def test_trainable_parameters_outside_the_lora_layers_are_synced_too(process_group, monkeypatch):
    model = with_lora(tiny_llama(), ["q_proj"])
    norm = model.get_parameter("base_model.model.model.norm.weight")
    norm.requires_grad_(True)
    with torch.no_grad():
        norm.mul_(2.0)
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()
    assert list(recorder.received)[-1] == "model.norm.weight" and recorder.ends[-2:] == [False, True]
    assert torch.equal(recorder.received["model.norm.weight"], norm.detach())


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_lora_on_a_tied_embedding_is_refused_with_the_flag_to_change(target, process_group, monkeypatch):
    # the adapted input embedding and the unadapted output head share one tensor in vLLM: no sync can express it
    model = with_lora(tiny_llama(tied=True), ["q_proj", target])
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    with pytest.raises(ValueError, match="--ds.lora.target_modules") as error:
        trainer.broadcast_to_vllm()
    assert target in str(error.value) and not recorder.calls


@pytest.mark.parametrize("peft_api", ["lora_variant (PEFT >= 0.16)", "use_dora alone (PEFT < 0.16)"])
def test_dora_is_refused_whatever_the_peft_version(peft_api, process_group, monkeypatch):
    """A DoRA adapter's weight is not W + scale * B @ A: the sync refuses it, with what to change, before sending
    anything. PEFT >= 0.16 marks it with a variant object; earlier PEFT with ``use_dora`` alone (simulated here by
    removing ``lora_variant``, which those versions lack)."""
    model = with_lora(tiny_llama(tied=False), ["q_proj", "v_proj"], use_dora=True)
    layers = lora_layers(model)
    if peft_api.startswith("use_dora"):
        for _, layer in layers:
            del layer.lora_variant
    assert all(lora_variant(layer, "default") is not None for _, layer in layers)
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    with pytest.raises(NotImplementedError, match="use_dora") as error:
        trainer.broadcast_to_vllm()
    assert "Dora" in str(error.value) or "DoRA" in str(error.value)
    assert not recorder.calls


@pytest.mark.parametrize("peft_api", ["lora_variant (PEFT >= 0.16)", "use_dora alone (PEFT < 0.16)"])
def test_plain_lora_is_no_variant_whatever_the_peft_version(peft_api):
    model = with_lora(tiny_llama(tied=False), ["q_proj"])
    for _, layer in lora_layers(model):
        if peft_api.startswith("use_dora"):
            del layer.lora_variant
        assert lora_variant(layer, "default") is None


def sync_costs(recorder):
    return dict(recorder.costs, resets=recorder.resets, ends=sum(recorder.ends), weights=len(recorder.calls))


@pytest.mark.parametrize("bucket_bytes", [1, 3000, 2**30], ids=["layer_per_bucket", "few_buckets", "one_bucket"])
@pytest.mark.parametrize("cls", [LoRASyncActorPPOTrainer, D3SActorPPOTrainer])
def test_a_lora_sync_costs_what_one_upstream_sync_costs(cls, bucket_bytes, process_group, monkeypatch):
    # upstream's own sync of a model without LoRA: its per-sync costs, spied on the real calls it makes
    trainer, recorder = trainer_for(tiny_llama(), cls, monkeypatch, prefix_caching=True)
    trainer.broadcast_to_vllm()
    upstream = sync_costs(recorder)
    assert (upstream["resets"], upstream["empty_cache"], upstream["barrier"], upstream["ends"]) == (1, 2, 1, 1)

    monkeypatch.setattr(lora_sync, "BUCKET_BYTES", bucket_bytes)
    model = with_lora(tiny_llama())
    trainer, recorder = trainer_for(model, cls, monkeypatch, prefix_caching=True)
    trainer.broadcast_to_vllm()
    lora = sync_costs(recorder)
    assert lora.pop("weights") == len(lora_layers(model)) and upstream.pop("weights") > len(lora_layers(model))
    assert lora == upstream


def test_buckets_hold_at_most_the_bound_and_zero3_gathers_one_layer_at_a_time(process_group, monkeypatch):
    model = with_lora(tiny_llama(), ["q_proj", "gate_proj", "down_proj"])
    layers = lora_layers(model)
    sizes = {base_name(name) + ".weight": layer.get_base_layer().weight.numel() * 4 for name, layer in layers}
    bound = max(sizes.values()) + min(sizes.values())  # some buckets of two layers, some of one
    monkeypatch.setattr(lora_sync, "BUCKET_BYTES", bound)
    buckets, gathered = [], []
    upstream_sync = lora_sync.MergedLoRASync._upstream_sync

    def recorded_sync(self, weights, first, last):
        buckets.append([name for name, _ in weights])
        upstream_sync(self, weights, first, last)

    def recorded_gather(params):
        gathered.append({id(p) for p in params})
        return contextlib.nullcontext()

    monkeypatch.setattr(lora_sync.MergedLoRASync, "_upstream_sync", recorded_sync)
    monkeypatch.setattr(lora_sync, "_gathered", recorded_gather)
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch, zero_stage=3)
    trainer.broadcast_to_vllm()

    assert [name for bucket in buckets for name in bucket] == list(sizes)  # every layer once, in order
    assert len(buckets) < len(sizes) and any(len(bucket) > 1 for bucket in buckets)
    for bucket, following in zip(buckets, buckets[1:] + [[]]):
        held = sum(sizes[name] for name in bucket)
        assert held <= bound  # and a bucket closes only when the next layer would not fit
        assert not following or held + sizes[following[0]] > bound
    assert gathered == [{id(p) for p in layer.parameters()} for _, layer in lora_layers(model)]


def test_a_layer_larger_than_the_bound_goes_alone(process_group, monkeypatch):
    monkeypatch.setattr(lora_sync, "BUCKET_BYTES", 1)
    model = with_lora(tiny_llama(), ["q_proj", "v_proj"])
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()
    assert list(recorder.received) == [base_name(name) + ".weight" for name, _ in lora_layers(model)]
    for name, tensor in recorder.received.items():
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0)
