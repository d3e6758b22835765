"""Self-check of the vLLM weight sync under the CPU runtime: do the engine's log-probs follow the trainer?

    python -m d3s_openrlhf.testbed.sync_check MODEL_DIR [--syncs 2] [--scale 0.5] [--lora-rank R [--update-std S]]

Starts one engine with OpenRLHF's ``create_vllm_engines``, then, ``--syncs`` times: changes the weights of a copy
of the model, pushes them with OpenRLHF's own trainer-side code (``ActorPPOTrainer._init_vllm_sync_group`` and
``broadcast_to_vllm``, run on a stand-in for the DeepSpeed actor that holds the changed Hugging Face model) and
compares the engine's prompt log-probs with the trainer's: the model's own forward in its dtype (bf16), the
forward the trainer's log-probs come from. Prints one JSON object.

With ``--lora-rank R`` the model carries a LoRA adapter of rank R on every linear layer (OpenRLHF's default
target modules); only the adapter changes, the sync is the package's merged one
(``integration.lora_sync.LoRASyncActorPPOTrainer``), and the reference is the trainer's forward as PEFT trains it,
the adapter apart from W (not a merged model). ``--update-std S`` sets the adapter to a fresh random one whose
update ``scale * B @ A`` has std S in every layer (instead of ``--scale``'s noise), and reports which share of the
update's effect on the trainer's log-probs reaches the engine's:
``<engine change, trainer change> / <trainer change, trainer change>``.
"""

import argparse
import contextlib
import json
import sys
from types import SimpleNamespace

PROMPTS = ("12+7=19", "3+45=48", "60+1=61", "27+38=65", "9+9=18", "41+5=46", "73+20=93", "8+14=22")


def engine_prompt_logprobs(engine, token_ids):
    import ray
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    output = ray.get(engine.generate.remote(token_ids, params))
    return torch.tensor(
        [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:])], dtype=torch.float32
    )


def trainer_prompt_logprobs(model, token_ids):
    """The prompt's log-probs under ``model``'s own forward in its dtype (a LoRA model unmerged), from fp32 logits."""
    import torch

    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


def logprobs(prompts, of):
    """``of(token_ids)`` for every prompt, concatenated."""
    import torch

    return torch.cat([of(token_ids) for token_ids in prompts])


def perturb(model, seed, scale):
    """Add seeded Gaussian noise of ``scale`` x each trainable weight's std (at least 0.2 for LoRA factors, which
    start at 0); the model stays bf16 (what OpenRLHF syncs)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            floor = 0.2 if "lora_" in name else 1e-3
            noise = torch.randn(param.shape, generator=generator) * (scale * param.float().std().clamp_min(floor))
            param.copy_((param.float() + noise).to(param.dtype))


def set_lora_update(model, seed, std):
    """A fresh random adapter in every LoRA layer whose update ``scale * B @ A`` has std ``std`` (in bf16, as
    OpenRLHF trains the adapter factors)."""
    import torch

    from d3s_openrlhf.integration.lora_sync import lora_layers

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for adapter in layer.active_adapters:
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                new_a = torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5
                new_b = torch.randn(b.shape, generator=generator)
                new_b *= std / (layer.scaling[adapter] * new_b @ new_a).std()
                a.copy_(new_a.to(a.dtype))
                b.copy_(new_b.to(b.dtype))


def effect_share(engine_change, trainer_change):
    """The share of the trainer's change that the engine's follows: the engine change's projection on it."""
    return float((engine_change * trainer_change).sum() / (trainer_change * trainer_change).sum())


@contextlib.contextmanager
def engine_and_trainer(model_dir, lora_rank=0, engine_swaps=tuple):
    """A running engine of ``model_dir`` (OpenRLHF's ``create_vllm_engines`` under the swaps ``engine_swaps()``
    returns once the CPU runtime is active: pairs (module, {global: replacement})) and a trainer whose sync reaches
    it: ``(engine, trainer, model)``, the trainer a stand-in for the DeepSpeed actor holding ``model`` (bf16; with
    ``lora_rank``, a PEFT LoRA model on every linear layer and the package's LoRA sync). Ray, the process group
    and the engine stop after the block."""
    import torch
    from transformers import AutoModelForCausalLM

    from d3s_openrlhf.cpu import runtime
    from d3s_openrlhf.integration.seams import swapped_globals

    runtime.activate()
    try:
        from openrlhf.trainer.ray import create_vllm_engines
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        from d3s_openrlhf.integration.lora_sync import LoRASyncActorPPOTrainer

        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        with contextlib.ExitStack() as swaps:
            for module, replacements in engine_swaps():
                swaps.enter_context(swapped_globals(module, **replacements))
            (engine,) = create_vllm_engines(1, 1, model_dir, 0, False, False, True, 64, None, 0.9)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        if lora_rank:
            import peft

            lora = peft.LoraConfig(
                task_type="CAUSAL_LM", r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear"
            )
            torch.manual_seed(0)  # the adapter's A factor starts random: the same check at every run
            model = peft.get_peft_model(model, lora)

        args = SimpleNamespace(
            vllm=SimpleNamespace(
                num_engines=1, tensor_parallel_size=1, sync_with_ray=False, enable_prefix_caching=False
            ),
            ds=SimpleNamespace(zero_stage=0, tensor_parallel_size=1),
        )
        # the attributes the sync reads (the trainer's __init__ builds optimizers and a replay buffer)
        trainer = object.__new__(LoRASyncActorPPOTrainer if lora_rank else ActorPPOTrainer)
        trainer.strategy = SimpleNamespace(args=args)
        trainer.vllm_engines = [engine]
        trainer.use_cuda_ipc = False
        trainer.actor = SimpleNamespace(model=SimpleNamespace(module=model), is_vlm=False)
        trainer._init_vllm_sync_group("gloo")
        yield engine, trainer, model
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        runtime.shutdown()


def prompt_token_ids(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in PROMPTS]


def run(model_dir, syncs, scale, lora_rank=0, update_std=None):
    prompts = prompt_token_ids(model_dir)
    with engine_and_trainer(model_dir, lora_rank) as (engine, trainer, model):
        results = {"prompts": len(prompts), "tied_embeddings": bool(model.config.tie_word_embeddings), "syncs": []}
        results["lora_rank"], results["update_std"] = lora_rank, update_std
        engine_before = logprobs(prompts, lambda ids: engine_prompt_logprobs(engine, ids))
        trainer_before = logprobs(prompts, lambda ids: trainer_prompt_logprobs(model, ids))
        results["initial_max_abs_diff"] = (engine_before - trainer_before).abs().max().item()
        for sync in range(syncs):
            if update_std is None:
                perturb(model, seed=sync + 1, scale=scale)
            else:
                set_lora_update(model, seed=sync + 1, std=update_std)
            target = logprobs(prompts, lambda ids: trainer_prompt_logprobs(model, ids))
            trainer.broadcast_to_vllm()
            after = logprobs(prompts, lambda ids: engine_prompt_logprobs(engine, ids))
            results["syncs"].append(
                {
                    "stale_max_abs_diff": (engine_before - target).abs().max().item(),
                    "synced_max_abs_diff": (after - target).abs().max().item(),
                    "trainer_change_norm": (target - trainer_before).norm().item(),
                    "engine_change_norm": (after - engine_before).norm().item(),
                    "effect_share": effect_share(after - engine_before, target - trainer_before),
                }
            )
            engine_before, trainer_before = after, target
        return results


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m d3s_openrlhf.testbed.sync_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model_dir")
    parser.add_argument("--syncs", type=int, default=2)
    parser.add_argument("--scale", type=float, default=0.5, help="noise, relative to each weight's std")
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank instead")
    parser.add_argument(
        "--update-std", type=float, default=None, help="with --lora-rank: a fresh adapter whose update has this std"
    )
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if options.update_std is not None and not options.lora_rank:
        parser.error("--update-std sets a LoRA adapter's update: give --lora-rank too")
    report = run(options.model_dir, options.syncs, options.scale, options.lora_rank, options.update_std)
    print("SYNC_CHECK " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
