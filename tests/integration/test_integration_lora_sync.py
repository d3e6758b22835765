"""The LoRA adapter sync around upstream's real ``ActorPPOTrainer.broadcast_to_vllm``, and the engine side's
install (``lora_engine``) as far as it runs without vLLM.

Real: a PEFT LoRA model on a tiny Llama (tied embeddings, as the toy and small Qwen2 models), upstream's
``broadcast_to_vllm`` (its transport for what else trains, its prefix-cache reset and barrier), a one-rank gloo
group, PEFT's own loader as the reader of the adapter checkpoint an engine writes. Stand-ins: the vLLM engines
(they record ``load_lora_adapter``, ``update_weight`` and cache resets, in order), the model-update group (it
records what is broadcast) and a vLLM worker (it records ``add_lora``). vLLM itself loads the adapter in
tests/e2e/test_e2e_vllm_weight_sync.py.
"""

import contextlib
from types import SimpleNamespace as NS

import openrlhf.trainer.ray.ppo_actor as ppo_actor
import pytest
import safetensors.torch
import torch

peft = pytest.importorskip("peft")

from d3s_openrlhf.integration import lora_engine, lora_sync  # noqa: E402
from d3s_openrlhf.integration.actor import D3SActorPPOTrainer  # noqa: E402
from d3s_openrlhf.integration.lora_sync import (  # noqa: E402
    LoRASyncActorPPOTrainer,
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
    """The vLLM engines and the model-update group of a sync: what reaches the engines (weights by name, adapters),
    and the order of the calls (``events``)."""

    def __init__(self):
        self.calls, self.received, self.ends, self.resets, self.adapters, self.events = [], {}, [], 0, [], []
        self.update_weight = NS(remote=self._update_weight)
        self.reset_prefix_cache = NS(remote=self._reset_prefix_cache)
        self.load_lora_adapter = NS(remote=self._load_lora_adapter)

    def _reset_prefix_cache(self):
        self.resets += 1
        self.events.append("reset_prefix_cache")

    def _load_lora_adapter(self, tensors, peft_config):
        self.adapters.append((tensors, peft_config))
        self.events.append("load_lora_adapter")

    def _update_weight(self, name, dtype, shape, empty_cache):
        self.calls.append((name, dtype, tuple(shape)))
        self.ends.append(empty_cache)
        self.events.append(name)
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
    monkeypatch.setattr(lora_sync, "ray", NS(get=lambda refs: refs, put=lambda value: value))
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


def adapter_names(model):
    return [f"{name}.lora_{factor}.weight" for name, _ in lora_layers(model) for factor in "AB"]


@pytest.mark.parametrize("cls", [LoRASyncActorPPOTrainer, D3SActorPPOTrainer])
@pytest.mark.parametrize("target_modules, tied", [("all-linear", True), (["q_proj", "v_proj", "lm_head"], False)])
def test_the_engines_receive_the_adapter_as_a_peft_checkpoint(cls, target_modules, tied, process_group, monkeypatch):
    model = with_lora(tiny_llama(tied=tied), target_modules)
    trainer, recorder = trainer_for(model, cls, monkeypatch)
    trainer.actor.model.module.train()  # dropout on: it acts on the layer's input, never on what is sent

    trainer.broadcast_to_vllm()

    ((tensors, config),) = recorder.adapters  # once per sync, nothing else sent: frozen weights are in the engine
    assert not recorder.calls
    assert list(tensors) == adapter_names(model)  # PEFT's checkpoint names, the adapter's name left out
    parameters = dict(model.named_parameters())
    for name, tensor in tensors.items():
        trained = parameters[name.replace(".weight", ".default.weight")]
        assert tensor.device.type == "cpu" and tensor.dtype == trained.dtype and torch.equal(tensor, trained.detach())
        assert tensor.data_ptr() != trained.data_ptr()  # a copy: the trainer goes on updating its own
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 16, "LORA")
    expected_targets = {"q_proj", "v_proj", "lm_head"} if isinstance(target_modules, list) else None
    assert expected_targets is None or set(config["target_modules"]) == expected_targets


def test_the_checkpoint_an_engine_writes_computes_the_trainers_policy(process_group, monkeypatch, tmp_path):
    model = with_lora(tiny_llama(tied=False), ["q_proj", "v_proj", "down_proj"])
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()
    ((tensors, config),) = recorder.adapters
    added = []
    worker = NS(rank=0, add_lora=lambda request: added.append(request) or True)

    directory = lora_engine.install_adapter(worker, safetensors.torch.save(tensors), config, str(tmp_path))

    (request,) = added  # vLLM's own loader, in place of the last sync's adapter under the one fixed id
    assert (request.lora_int_id, request.lora_path, request.load_inplace) == (lora_engine.ADAPTER_ID, directory, True)
    assert sorted(p.name for p in tmp_path.joinpath("worker0").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    served = peft.PeftModel.from_pretrained(tiny_llama(tied=False), directory)  # PEFT's reader of the checkpoint
    tokens = torch.randint(0, VOCAB, (3, 7))
    model.eval()
    torch.testing.assert_close(served(input_ids=tokens).logits, model(input_ids=tokens).logits, atol=0, rtol=0)


def test_the_engine_serves_the_adapter_on_every_request_once_synced():
    generated = []
    llm = NS(generate=lambda *args, **kwargs: generated.append(kwargs) or "output", sleep="upstream's")
    actor = NS(_d3s_adapter=None)
    serving = lora_engine._ServingAdapter(llm, actor)
    assert serving.generate("prompt", "params", request_id="a") == "output" and serving.sleep == "upstream's"
    actor._d3s_adapter = "the synced adapter's request"
    serving.generate("prompt", "params", request_id="b")
    assert generated == [{"request_id": "a"}, {"request_id": "b", "lora_request": "the synced adapter's request"}]


def test_without_lora_the_sync_is_upstreams(process_group, monkeypatch):
    model = tiny_llama()
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()
    assert list(recorder.received) == [name for name, _ in model.named_parameters()]
    assert recorder.ends == [False] * (len(recorder.ends) - 1) + [True] and not recorder.adapters
    for name, param in model.named_parameters():
        assert torch.equal(recorder.received[name], param.detach())


def test_trainable_parameters_outside_the_lora_layers_are_synced_after_the_adapter(process_group, monkeypatch):
    model = with_lora(tiny_llama(), ["q_proj"])
    norm = model.get_parameter("base_model.model.model.norm.weight")
    norm.requires_grad_(True)
    with torch.no_grad():
        norm.mul_(2.0)
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()
    # after: a weight reload (the CPU runtime's) unloads adapters, which the engine then loads again from its files
    assert recorder.events == ["load_lora_adapter", "model.norm.weight"] and recorder.ends == [True]
    assert torch.equal(recorder.received["model.norm.weight"], norm.detach())


def test_under_4bit_the_dequantized_base_of_the_adapted_layers_goes_once(process_group, monkeypatch):
    # --ds.load_in_4bit: the trainer's base is the quantized one, the engine loaded the checkpoint's (bitsandbytes'
    # own dequantization stands in: its 4-bit layers need CUDA)
    model = with_lora(tiny_llama(), ["q_proj", "v_proj"])
    quantized = {id(layer.get_base_layer()) for name, layer in lora_layers(model) if name.endswith("q_proj")}
    monkeypatch.setattr(lora_sync, "_is_quantized", lambda module: id(module) in quantized)
    monkeypatch.setattr(lora_sync, "dequantize_module_weight", lambda module: module.weight * 2)
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    trainer.broadcast_to_vllm()
    trainer.broadcast_to_vllm()
    q_proj = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]
    assert recorder.events == ["load_lora_adapter", *q_proj, "load_lora_adapter"]
    for name in q_proj:
        base = model.get_parameter("base_model.model." + name.replace(".weight", ".base_layer.weight"))
        assert torch.equal(recorder.received[name], base.detach() * 2)


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_lora_on_a_tied_embedding_is_refused_with_the_flag_to_change(target, process_group, monkeypatch):
    # the adapted input embedding and the unadapted output head share one tensor in vLLM: no sync can express it
    model = with_lora(tiny_llama(tied=True), ["q_proj", target])
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    with pytest.raises(ValueError, match="--ds.lora.target_modules") as error:
        trainer.broadcast_to_vllm()
    assert target in str(error.value) and not recorder.events


def test_lora_on_an_embedding_is_refused_with_the_flag_to_change(process_group, monkeypatch):
    model = with_lora(tiny_llama(tied=False), ["q_proj", "embed_tokens"])
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch)
    with pytest.raises(NotImplementedError, match="--ds.lora.target_modules") as error:
        trainer.broadcast_to_vllm()
    assert "embed_tokens" in str(error.value) and not recorder.events


@pytest.mark.parametrize("peft_api", ["lora_variant (PEFT >= 0.16)", "use_dora alone (PEFT < 0.16)"])
def test_dora_is_refused_whatever_the_peft_version(peft_api, process_group, monkeypatch):
    """vLLM serves plain LoRA: the sync refuses a DoRA adapter, with what to change, before sending anything. PEFT
    >= 0.16 marks it with a variant object; earlier PEFT with ``use_dora`` alone (simulated here by removing
    ``lora_variant``, which those versions lack)."""
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
    assert not recorder.events


@pytest.mark.parametrize("peft_api", ["lora_variant (PEFT >= 0.16)", "use_dora alone (PEFT < 0.16)"])
def test_plain_lora_is_no_variant_whatever_the_peft_version(peft_api):
    model = with_lora(tiny_llama(tied=False), ["q_proj"])
    for _, layer in lora_layers(model):
        if peft_api.startswith("use_dora"):
            del layer.lora_variant
        assert lora_variant(layer, "default") is None


def sync_costs(recorder):
    return dict(recorder.costs, resets=recorder.resets)


@pytest.mark.parametrize("cls", [LoRASyncActorPPOTrainer, D3SActorPPOTrainer])
def test_a_lora_sync_costs_what_one_upstream_sync_costs(cls, process_group, monkeypatch):
    # upstream's own sync of a model without LoRA: its per-sync costs, spied on the real calls it makes
    trainer, recorder = trainer_for(tiny_llama(), cls, monkeypatch, prefix_caching=True)
    trainer.broadcast_to_vllm()
    upstream = sync_costs(recorder)
    assert (upstream["resets"], upstream["empty_cache"], upstream["barrier"]) == (1, 2, 1)

    trainer, recorder = trainer_for(with_lora(tiny_llama()), cls, monkeypatch, prefix_caching=True)
    trainer.broadcast_to_vllm()
    assert sync_costs(recorder) == upstream
    # the cache reset after the install: no block cached under the previous adapter's name and path survives
    assert recorder.events == ["load_lora_adapter", "reset_prefix_cache"]


def test_zero3_gathers_each_layers_factors_by_themselves(process_group, monkeypatch):
    model = with_lora(tiny_llama(), ["q_proj", "gate_proj", "down_proj"])
    gathered = []

    def recorded_gather(params):
        gathered.append({id(p) for p in params})
        return contextlib.nullcontext()

    monkeypatch.setattr(lora_sync, "_gathered", recorded_gather)
    trainer, recorder = trainer_for(model, LoRASyncActorPPOTrainer, monkeypatch, zero_stage=3)
    trainer.broadcast_to_vllm()
    factors = [
        {id(layer.lora_A["default"].weight), id(layer.lora_B["default"].weight)} for _, layer in lora_layers(model)
    ]
    assert gathered == factors and len(recorder.adapters) == 1


def test_every_rollout_returns_its_sampled_tokens_log_probs():
    import asyncio

    from vllm import SamplingParams

    class Upstream:
        async def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1):
            return sampling_params

    class Serving(lora_engine.LoRAServing, Upstream):
        pass

    engine = object.__new__(Serving)  # its __init__ starts vLLM
    params = SamplingParams(temperature=0.7, max_tokens=5)
    served = asyncio.run(engine.generate_responses("prompt", "label", params, 16, None, num_samples=2))
    assert served.logprobs == 0 and params.logprobs is None  # the sampled token's alone; the caller's untouched
    assert (served.temperature, served.max_tokens) == (0.7, 5)
    asked = SamplingParams(logprobs=1)  # upstream's, under IS correction: as asked
    assert asyncio.run(engine.generate_responses("prompt", "label", asked, 16, None)) is asked


@pytest.mark.parametrize("rank", [0, 8])
def test_the_training_step_logs_the_engine_gap_on_the_generated_tokens(rank):
    class Upstream:
        def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
            return dict(experience.info)

    class Trainer(lora_sync.AdapterLoRASync, Upstream):
        args = NS(ds=NS(lora=NS(rank=rank)))

    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    trainer_log_probs = torch.tensor([[-1.1, -2.0, -9.0], [-0.5, -0.2, 0.0]])
    action_mask = torch.tensor([[True, True, False], [True, True, False]])
    experience = NS(rollout_log_probs=rollout, action_log_probs=trainer_log_probs, action_mask=action_mask, info={})
    info = Trainer().training_step(experience, 0.0, 0)
    if rank:  # the mean of |0.1|, 0, 0, |0.3| over the 4 generated tokens, padding out
        torch.testing.assert_close(info["lora/engine_gap"], torch.tensor(0.1))
    else:  # no LoRA: upstream's step
        assert info == {}
    experience = NS(rollout_log_probs=None, action_log_probs=trainer_log_probs, action_mask=action_mask, info={})
    assert Trainer().training_step(experience, 0.0, 0) == {}  # no engine log-probs (another engine class): none
