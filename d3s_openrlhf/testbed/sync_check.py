"""Self-check of the vLLM weight sync under the CPU runtime: do the engine's log-probs follow the trainer?

    python -m d3s_openrlhf.testbed.sync_check MODEL_DIR [--syncs 2]

Starts one engine with OpenRLHF's ``create_vllm_engines``, then, ``--syncs`` times: perturbs a copy of the
model's weights, pushes them with OpenRLHF's own trainer-side code (``ActorPPOTrainer._init_vllm_sync_group``
and ``broadcast_to_vllm``, run on a stand-in for the DeepSpeed actor that holds the perturbed Hugging Face
model) and compares the engine's prompt log-probs with the perturbed model's. Prints one JSON object.
"""

import argparse
import json
import socket
import sys
from types import SimpleNamespace

PROMPT = "12+7=19"


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    import torch

    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model.float()(ids).logits.float()
    model.to(torch.bfloat16)
    return torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


def perturb(model, seed, scale):
    """Add seeded Gaussian noise of ``scale`` x each weight's std; the model stays bf16 (what OpenRLHF syncs)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator) * (scale * param.float().std().clamp_min(1e-3))
            param.copy_((param.float() + noise).to(param.dtype))


def run(model_dir, syncs, scale):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s_openrlhf.cpu import runtime

    runtime.activate()
    try:
        from openrlhf.trainer.ray import create_vllm_engines
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
        engines = create_vllm_engines(1, 1, model_dir, 0, False, False, True, 64, None, 0.9)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        token_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)

        args = SimpleNamespace(
            vllm=SimpleNamespace(
                num_engines=1, tensor_parallel_size=1, sync_with_ray=False, enable_prefix_caching=False
            ),
            ds=SimpleNamespace(zero_stage=0, tensor_parallel_size=1),
        )
        trainer = SimpleNamespace(
            strategy=SimpleNamespace(args=args),
            vllm_engines=engines,
            use_cuda_ipc=False,
            actor=SimpleNamespace(model=SimpleNamespace(module=model), is_vlm=False),
        )
        ActorPPOTrainer._init_vllm_sync_group(trainer, "gloo")

        results = {"prompt": PROMPT, "tied_embeddings": bool(model.config.tie_word_embeddings), "syncs": []}
        before = engine_prompt_logprobs(engines[0], token_ids)
        results["initial_max_abs_diff"] = (before - model_prompt_logprobs(model, token_ids)).abs().max().item()
        for sync in range(syncs):
            perturb(model, seed=sync + 1, scale=scale)
            target = model_prompt_logprobs(model, token_ids)
            ActorPPOTrainer.broadcast_to_vllm(trainer)
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
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print("SYNC_CHECK " + json.dumps(run(options.model_dir, options.syncs, options.scale)), flush=True)


if __name__ == "__main__":
    main()
