"""Self-check of the vLLM weight sync under the CPU runtime: do the engine's log-probs follow the trainer?

    python -m d3s_openrlhf.testbed.sync_check MODEL_DIR [--syncs 2] [--lora-rank R]

Starts one engine with OpenRLHF's ``create_vllm_engines``, then, ``--syncs`` times: perturbs a copy of the
model's weights, pushes them with OpenRLHF's own trainer-side code (``ActorPPOTrainer._init_vllm_sync_group``
and ``broadcast_to_vllm``, run on a stand-in for the DeepSpeed actor that holds the perturbed Hugging Face
model) and compares the engine's prompt log-probs with the perturbed model's. Prints one JSON object.

With ``--lora-rank R`` the model carries a LoRA adapter of rank R on every linear layer (OpenRLHF's default
target modules); only the adapter is perturbed, and the sync is the package's merged one
(``integration.lora_sync.LoRASyncActorPPOTrainer``).
"""

import argparse
import json
import sys
from types import SimpleNamespace

from d3s_openrlhf.testbed.ray_cluster import free_port

PROMPT = "12+7=19"


def engine_prompt_logprobs(engine, token_ids):
    import ray
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    output = ray.get(engine.generate.remote(token_ids, params))
    return torch.tensor(
        [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:])], dtype=torch.float32
    )


def model_prompt_logprobs(model, token_ids):
    """The prompt's log-probs under ``model`` computed in fp32; a LoRA model is first merged by PEFT in its dtype
    (bf16), the form in which an engine serves it: the merge's own rounding is not the sync's error."""
    import copy

    import torch

    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()

    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model.float()(ids).logits.float()
    model.to(torch.bfloat16)
    return torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


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


def run(model_dir, syncs, scale, lora_rank=0):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s_openrlhf.cpu import runtime

    runtime.activate()
    try:
        from openrlhf.trainer.ray import create_vllm_engines
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        from d3s_openrlhf.integration.lora_sync import LoRASyncActorPPOTrainer

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        engines = create_vllm_engines(1, 1, model_dir, 0, False, False, True, 64, None, 0.9)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        token_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
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
        trainer.vllm_engines = engines
        trainer.use_cuda_ipc = False
        trainer.actor = SimpleNamespace(model=SimpleNamespace(module=model), is_vlm=False)
        trainer._init_vllm_sync_group("gloo")

        results = {"prompt": PROMPT, "tied_embeddings": bool(model.config.tie_word_embeddings), "syncs": []}
        results["lora_rank"] = lora_rank
        before = engine_prompt_logprobs(engines[0], token_ids)
        results["initial_max_abs_diff"] = (before - model_prompt_logprobs(model, token_ids)).abs().max().item()
        for sync in range(syncs):
            perturb(model, seed=sync + 1, scale=scale)
            target = model_prompt_logprobs(model, token_ids)
            trainer.broadcast_to_vllm()
            after = engine_prompt_logprobs(engines[0], token_ids)
            results["syncs"].append(
                {
                    "stale_max_abs_diff": (before - target).abs().max().item(),
                    "synced_max_abs_diff": (after - target).abs().max().item(),
                }
            )
            before = after
        return results
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        runtime.shutdown()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m d3s_openrlhf.testbed.sync_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model_dir")
    parser.add_argument("--syncs", type=int, default=2)
    parser.add_argument("--scale", type=float, default=0.5, help="noise, relative to each weight's std")
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank instead")
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    report = run(options.model_dir, options.syncs, options.scale, options.lora_rank)
    print("SYNC_CHECK " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
