"""The actor's training step through OpenRLHF's ``Actor`` on a GPU: upstream's ``Actor.forward`` and backward
against ours, ``training_forward`` (torch, transformers and openrlhf; no Ray, vLLM or DeepSpeed process).

A Qwen2 model with Qwen2.5's 151,936-token vocabulary and an untied head, random weights in bf16, sdpa attention,
wrapped in OpenRLHF's ``Actor`` (temperature 0.6); a batch of B sequences of a prompt and a response of random
length up to R tokens, right-padded (the experience maker's layout). Per shape (``--shapes``):

* ``train step: upstream``: ``Actor.forward`` (the fp32 logits of every position, on the path its
  ``log_probs_from_logits`` takes on this device: flash-attn's Triton cross-entropy on CUDA where it imports; the
  output's ``upstream_path`` says which ran) and the backward of PPO-clip over every action token;
* ``train step: ours all tokens``: ``training_forward`` at every action token (what a KL loss, GSPO, an entropy
  bonus or K = 1 with ``--d3s.chunked_logits`` run), the same loss;
* ``train step: ours K=0.2``: ``training_forward`` at the top 20% of the action tokens by |A| x score (D3S's token
  level, PPO-clip alone), PPO-clip over them;
* ``train step: body only (no head)``: the model up to its head, forward and backward: the part of the step that
  is the same in every variant;
* ``experience fwd (entropy)``: the experience-making forward with the entropy the token scores read, no grad:
  upstream's ``Actor.forward(return_entropy=True)`` against ours (``action_log_probs_entropy``).

``max |log p - upstream|`` checks that the variants compute the same log-probs. Peak = ``max_memory_allocated``
above the level at the call (weights and gradient buffers exist before, as in training); time = median of
``--repeats`` synchronised calls after a warm-up (``bench_forward_gpu.measure``).

    PYTHONPATH=$PWD python benchmarks/bench_actor_gpu.py                  # 7B and 1.5B heads, few body layers
    PYTHONPATH=$PWD python benchmarks/bench_actor_gpu.py --shapes qwen2.5-1.5b qwen2.5-7b --checkpointing \\
        --json benchmarks/results/actor_gpu_full_depth.json             # 28 layers, as the launch scripts train
    .venv/bin/python benchmarks/report.py                                 # the tables in RESULTS.md (section 6)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from openrlhf.models import Actor
from transformers import Qwen2Config, Qwen2ForCausalLM

from bench_forward_gpu import environment, measure  # benchmarks/ is sys.path[0] when this file runs
from d3s_openrlhf.integration.training_forward import action_log_probs_entropy, training_forward
from upstream_logprobs import torch_fallback, upstream_path

TEMPERATURE = 0.6
VOCAB = 151_936
KEPT = 0.2


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    intermediate: int
    batch: int
    prompt: int
    response: int  # the longest response; the others are drawn from [response / 3, response]
    vocab: int = VOCAB


SHAPES = {
    # the heads of Qwen2.5-7B and -1.5B over a few body layers: the head's share of a step at its largest
    "7b-head": Shape(3584, 28, 4, 2, 18944, batch=4, prompt=1024, response=3072),
    "1.5b-head": Shape(1536, 12, 2, 4, 8960, batch=8, prompt=512, response=1536),
    # the whole models' shapes (28 layers), at batches one 80 GB card holds without checkpointing
    "qwen2.5-1.5b": Shape(1536, 12, 2, 28, 8960, batch=8, prompt=512, response=1536),
    "qwen2.5-7b": Shape(3584, 28, 4, 28, 18944, batch=2, prompt=1024, response=2048),
    # a smoke run on a CPU
    "toy": Shape(64, 4, 2, 1, 128, batch=3, prompt=8, response=24, vocab=1000),
}


def make_actor(shape: Shape, device, checkpointing: bool) -> Actor:
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.prompt + shape.response,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    actor = Actor(model, temperature=TEMPERATURE)
    actor.packing_samples = False
    if checkpointing:  # --actor.gradient_checkpointing_enable: upstream's non-reentrant default
        actor.gradient_checkpointing_enable()
    actor.train()
    return actor


def make_batch(shape: Shape, device):
    """Right-padded (B, P + R) sequences, their (B, R) action mask, advantages and token scores."""
    g = torch.Generator().manual_seed(1)
    width = shape.prompt + shape.response
    sequences = torch.randint(0, shape.vocab, (shape.batch, width), generator=g)
    lengths = torch.randint(shape.response // 3, shape.response + 1, (shape.batch,), generator=g)
    lengths[0] = shape.response
    attention_mask = (torch.arange(width)[None] < shape.prompt + lengths[:, None]).long()
    action_mask = torch.arange(shape.response)[None] < lengths[:, None]
    advantages = torch.randn(shape.batch, shape.response, generator=g) * action_mask
    scores = advantages.abs() * torch.rand(shape.batch, shape.response, generator=g) * action_mask
    kept = torch.zeros(action_mask.numel(), dtype=torch.bool)
    kept[scores.flatten().topk(max(1, int(KEPT * int(action_mask.sum())))).indices] = True
    kept = kept.view_as(action_mask) & action_mask
    return tuple(t.to(device) for t in (sequences, attention_mask, action_mask, advantages, kept))


def ppo_clip(log_probs, old, advantages, mask):
    ratio = torch.exp(log_probs - old)
    surrogate = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    return (surrogate * mask).sum() / mask.sum()


def run_shape(name: str, args) -> dict:
    shape = SHAPES[name]
    actor = make_actor(shape, args.device, args.checkpointing)
    sequences, attention_mask, action_mask, advantages, kept = make_batch(shape, args.device)
    with torch.no_grad():
        old = Actor.forward(actor, sequences, action_mask, attention_mask)

    forwards = {
        "upstream": lambda: (Actor.forward(actor, sequences, action_mask, attention_mask), action_mask),
        "ours all tokens": lambda: (training_forward(actor, sequences, action_mask, attention_mask), action_mask),
        f"ours K={KEPT:g}": lambda: (
            training_forward(actor, sequences, action_mask, attention_mask, log_prob_mask=kept, fill_log_probs=old),
            kept,
        ),
    }

    def step(forward):
        def run():
            actor.zero_grad(set_to_none=False)
            log_probs, mask = forward()
            ppo_clip(log_probs, old, advantages, mask).backward()

        return run

    def body_step():
        actor.zero_grad(set_to_none=False)
        hidden = actor.model.model(sequences, attention_mask=attention_mask).last_hidden_state
        hidden.float().pow(2).mean().backward()

    def experience_upstream():
        with torch.no_grad():
            Actor.forward(actor, sequences, action_mask, attention_mask, return_output=True, return_entropy=True)

    def experience_ours():
        with torch.no_grad():
            action_log_probs_entropy(actor, sequences, action_mask, attention_mask, action_mask, with_entropy=True)

    row = {
        "shape": asdict(shape),
        "config": (
            f"Qwen2 H={shape.hidden} L={shape.layers} V={shape.vocab} untied, {str(next(actor.parameters()).dtype)[6:]}"
            f", sdpa; B={shape.batch} x (prompt {shape.prompt} + response <= {shape.response}), "
            f"{int(action_mask.sum())} action tokens" + (", gradient checkpointing" if args.checkpointing else "")
        ),
        "action_tokens": int(action_mask.sum()),
    }
    with torch.no_grad():  # the same log-probs, at the tokens each variant computes
        for variant, forward in forwards.items():
            log_probs, mask = forward()
            row[f"max |log p - upstream|: {variant}"] = float(((log_probs - old) * mask).abs().max())
    for variant, forward in forwards.items():
        row[f"train step: {variant}"] = measure(step(forward), args.device, args.repeats)
    row["train step: body only (no head)"] = measure(body_step, args.device, args.repeats)
    row["experience fwd (entropy): upstream"] = measure(experience_upstream, args.device, args.repeats)
    row["experience fwd (entropy): ours"] = measure(experience_ours, args.device, args.repeats)
    return row


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["7b-head", "1.5b-head"])
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing, as the scripts train")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "actor_gpu.json")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    result = {**environment(args.device), "upstream_path": upstream_path(args.device), "repeats": args.repeats}
    result["argv"] = [arg for arg in argv or sys.argv[1:] if arg != "--json" and not arg.endswith(".json")]
    result["shapes"] = {}
    # upstream's torch path wherever its Triton kernel is not what it runs (a CPU with triton installed included)
    with contextlib.nullcontext() if result["upstream_path"].startswith("flash-attn") else torch_fallback():
        for name in args.shapes:
            result["shapes"][name] = run_shape(name, args)
            print(f"{name}: {json.dumps(result['shapes'][name])}", flush=True)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
