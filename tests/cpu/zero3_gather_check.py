"""Run by tests/cpu/test_cpu_patches.py as a script (its spawned ranks must import it): the seeded stress
loop of issue 30 item 5. For each configuration and random model, two gloo ranks (the CPU runtime, ``patches.apply``)
load a randomly initialised Qwen2 from a checkpoint under DeepSpeed ZeRO-3, optionally with LoRA (rank 8, all
linear layers), a tied embedding large enough to be partitioned, packing, gradient checkpointing, temperature
0.7, then check that

* every parameter equals the checkpoint (gathered one at a time);
* the chunked-logits experience forward (log-probs and entropy) is finite over eight random packed batches per rank,
  the last of them without any action token on rank 1.

Gloo runs async collectives on a pool of threads, so an all-gather may complete after a later one. Two switches in
each rank make that deterministic: each async all-gather runs at once into a private buffer and delivers its result
into the caller's tensor only at its ``wait()`` or at the next blocking collective, whichever comes first (a schedule
gloo may take), and torch fills uninitialised memory with NaN (so memory nobody wrote reads NaN, not stale bytes).
``--upstream-gather`` puts back DeepSpeed's own blocking gather in place of the CPU runtime's (the fault it fixes).

Prints one line per model, ``model LORA_RANK:PACKING:TIED:MODEL_SEED [(rank, [problems]), ...]``, then ``clean`` or
``FOUND``.

    python zero3_gather_check.py [--upstream-gather] LORA_RANK:PACKING:TIED:MODEL_SEED [...]
"""

import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

WORLD = 2
VOCAB = 4096  # 4096 x 64: above ZeRO-3's persistence threshold (1e5), so the tied embedding is partitioned
BATCHES = 8


def build(path, seed, tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


class _LateDelivery:
    """An async all-gather whose result reaches the caller's tensor at its ``wait()`` or at the next blocking
    collective (a broadcast, a blocking all-gather), not before: a later async all-gather may complete first."""

    pending = []

    def __init__(self, output, staged):
        self.output, self.staged, self.delivered = output, staged, False
        _LateDelivery.pending.append(self)

    def deliver(self):
        if not self.delivered:
            self.output.copy_(self.staged)
            self.delivered = True

    def wait(self, timeout=None):
        self.deliver()
        return True

    def is_completed(self):
        return self.delivered

    @classmethod
    def flush(cls):
        for work in cls.pending:
            work.deliver()
        cls.pending = []


def _gloo_completing_late():
    import torch.distributed as dist

    all_gather_into_tensor, broadcast = dist.all_gather_into_tensor, dist.broadcast

    def gather(output_tensor, input_tensor, group=None, async_op=False):
        if not async_op:
            _LateDelivery.flush()
            return all_gather_into_tensor(output_tensor, input_tensor, group=group)
        staged = torch.empty_like(output_tensor)
        all_gather_into_tensor(staged, input_tensor, group=group)
        return _LateDelivery(output_tensor, staged)

    def broadcast_after_flush(tensor, src=None, group=None, async_op=False, **kwargs):
        _LateDelivery.flush()
        return broadcast(tensor, src=src, group=group, async_op=async_op, **kwargs)

    dist.all_gather_into_tensor, dist.broadcast = gather, broadcast_after_flush


def _checkpoint_mismatches(model, path):
    """Names of the parameters that differ from the checkpoint (or hold non-finite values), each gathered alone."""
    import deepspeed
    from safetensors.torch import load_file

    saved = load_file(os.path.join(path, "model.safetensors"))
    bad = []
    for name, param in model.named_parameters():
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        with deepspeed.zero.GatheredParameters([param]):
            value = param.data.clone()
        if key in saved:
            if not torch.equal(value, saved[key].to(value.dtype)):
                bad.append(name)
        elif not torch.isfinite(value).all():  # a LoRA factor, initialised here
            bad.append(name)
    return bad


def batch(seed, rank):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    rows = int(torch.randint(1, 5, (1,), generator=g))
    prompt, width = 6, 5
    sequences = torch.randint(0, VOCAB, (rows, prompt + width), generator=g)
    attention_mask = torch.ones_like(sequences)
    for r in range(rows):
        left = int(torch.randint(0, 4, (1,), generator=g))
        response = int(torch.randint(1, width + 1, (1,), generator=g))
        attention_mask[r, :left] = 0
        attention_mask[r, prompt + response :] = 0
    if seed == BATCHES - 1 and rank == 1:  # a rank without an action token to score (empty responses)
        attention_mask[:, prompt:] = 0
    return sequences * attention_mask, attention_mask[:, prompt:].bool(), attention_mask


def worker(rank, path, port, lora, packing, upstream_gather, result):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # memory nobody wrote reads NaN
    if upstream_gather:
        from deepspeed.runtime.zero.partition_parameters import Init

        upstream = Init._allgather_params_coalesced
    from d3s_openrlhf.cpu import patches

    patches.apply()
    if upstream_gather:
        Init._allgather_params_coalesced = upstream
    _gloo_completing_late()
    import deepspeed
    from openrlhf.models import Actor

    from d3s_openrlhf.integration.experience_forward import chunked_logits_log_probs
    from d3s_openrlhf.integration.training_forward import causal_lm

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
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
    problems = [f"differs from the checkpoint: {name}" for name in _checkpoint_mismatches(causal_lm(actor), path)]
    for seed in range(BATCHES):
        sequences, action_mask, attention_mask = batch(seed, rank)
        try:
            log_probs, entropy = chunked_logits_log_probs(
                actor, sequences, action_mask, attention_mask, with_entropy=True
            )
        except FloatingPointError as error:
            problems.append(f"batch {seed}: {error}")
            continue
        if not (torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()):
            problems.append(f"batch {seed}: non-finite output")
    result.put((rank, problems))


def main():
    from d3s_openrlhf.cpu.ports import free_port

    args = sys.argv[1:]
    upstream_gather = bool(args) and args[0] == "--upstream-gather"
    args = args[upstream_gather:]
    ctx = mp.get_context("spawn")
    found = []
    for spec in args:
        lora, packing, tied, seed = (int(x) for x in spec.split(":"))
        with tempfile.TemporaryDirectory() as path:
            build(path, seed, bool(tied))
            result = ctx.Queue()
            port = free_port()  # below the ephemeral range and not DeepSpeed's default, which other jobs use
            procs = [
                ctx.Process(target=worker, args=(r, path, port, lora, bool(packing), upstream_gather, result))
                for r in range(WORLD)
            ]
            for process in procs:
                process.start()
            outs = sorted(result.get(timeout=600) for _ in procs)
            for process in procs:
                process.join()
            if any(problems for _, problems in outs):
                found.append(spec)
            print("model", spec, outs, flush=True)
    print("FOUND" if found else "clean", found, flush=True)


if __name__ == "__main__":
    main()
