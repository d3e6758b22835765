"""Run by tests/integration/test_integration_experience_forward.py as a script (its spawned ranks must import it):
the head-free experience forward under DeepSpeed ZeRO-3 on 2 gloo ranks (CPU runtime stand-ins), LoRA rank 8 on a
randomly initialised Qwen2 with tied embeddings, packing, gradient checkpointing, temperature 0.7; eight random
packed batches per rank. Prints one line per model: ``model SEED [(rank, [(batch, rank, non-finite entropies,
non-finite log-probs), ...]), ...]``, then ``clean`` or ``FOUND``.

    VOCAB=4096 python zero3_head_free_check.py LORA_RANK PACKING(0/1) TIED(0/1) MODEL_SEED [MODEL_SEED ...]
"""

import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

WORLD = 2
VOCAB = int(os.environ.get("VOCAB", "512"))


def build(path, seed, tied=True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def worker(rank, path, seeds, port, lora, packing, result):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from d3s_openrlhf.cpu import patches

    patches.apply()
    import deepspeed
    from openrlhf.models import Actor

    from d3s_openrlhf.integration.experience_forward import head_free_log_probs

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
    }
    actor = Actor(
        path,
        attn_implementation="flash_attention_2",
        param_dtype="bf16",
        lora_rank=lora,
        lora_alpha=16,
        target_modules="all-linear",
        ds_config=ds_config,
        packing_samples=packing,
        temperature=0.7,
    )
    actor.gradient_checkpointing_enable()
    optim = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=actor.model, optimizer=optim, config=ds_config)
    actor.model = engine
    actor.eval()
    bad = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed * 10 + rank)
        rows = int(torch.randint(1, 5, (1,), generator=g))
        prompt, width = 6, 5
        seq = torch.randint(0, VOCAB, (rows, prompt + width), generator=g)
        attn = torch.ones_like(seq)
        for r in range(rows):
            left = int(torch.randint(0, 4, (1,), generator=g))
            resp = int(torch.randint(1, width + 1, (1,), generator=g))
            attn[r, :left] = 0
            attn[r, prompt + resp:] = 0
        action_mask = attn[:, prompt:].bool()
        seq = seq * attn
        lp, ent = head_free_log_probs(actor, seq, action_mask, attn)
        if not (torch.isfinite(lp).all() and torch.isfinite(ent).all()):
            bad.append((seed, rank, int((~torch.isfinite(ent)).sum()), int((~torch.isfinite(lp)).sum())))
    result.put((rank, bad))


def main():
    lora, packing, tied, seeds = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1", map(int, sys.argv[4:])
    ctx = mp.get_context("spawn")
    found = []
    for m in seeds:
        with tempfile.TemporaryDirectory() as path:
            build(path, m, tied)
            result = ctx.Queue()
            port = 29500 + (os.getpid() + m) % 1000
            procs = [
                ctx.Process(target=worker, args=(r, path, range(8), port, lora, packing, result)) for r in range(WORLD)
            ]
            for process in procs:
                process.start()
            outs = [result.get(timeout=600) for _ in procs]
            for process in procs:
                process.join()
            for rank, bad in outs:
                if bad:
                    found.append((m, rank, bad))
            print("model", m, outs, flush=True)
    print("FOUND" if found else "clean", found)


if __name__ == "__main__":
    main()
